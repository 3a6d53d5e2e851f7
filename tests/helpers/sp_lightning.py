"""HF causal LMs from their configs as a LightningModule for the sequence-parallel Trainer tests, its token data,
and the per-rank result files (losses each step, final weights) compared with a plain-DDP reference."""

from __future__ import annotations

import os
from typing import Optional

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

transformers = pytest.importorskip("transformers")
VOCAB, SEQ = 97, 16


def make_lm(kind: str):
    """A tiny GPT-2 or Llama (GQA: 4 query heads, 4 or 2 key/value heads) with no dropout: any S in 1, 2, 4 divides."""
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
        return transformers.LlamaForCausalLM(cfg)
    raise ValueError(kind)


class Tokens(Dataset):
    """Token sequences; with ``padded``, odd items end in padding (attention_mask 0, label -100)."""

    def __init__(self, n: int, padded: bool) -> None:
        self.n, self.padded = n, padded

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(31 * i + 7))
        mask = torch.ones(SEQ, dtype=torch.long)
        labels = ids.clone()
        if self.padded and i % 2:
            mask[SEQ - 5:] = 0
            labels[SEQ - 5:] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class SPModule(pl.LightningModule):
    """``kind``'s model trained on dict batches; ``sparse``: its attention block-sparse first (a local window)."""

    def __init__(self, kind: str, out: str, tag: str, sparse: bool = False, padded: bool = False, n_items: int = 12,
                 lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = make_lm(kind)
        if sparse:
            from lightning_zero.sparse_attention import sparsify_causal_lm

            sparsify_causal_lm(self.model, layout="local", block=4)
        self.losses: list[float] = []

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)  # a forked rank must not use the parent's OpenMP pool

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(self.hparams.n_items, self.hparams.padded), batch_size=2, shuffle=False)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def on_fit_end(self) -> None:  # after the strategy's teardown: the module is whole again
        path = os.path.join(self.hparams.out, f"{self.hparams.tag}rank{self.global_rank}.pt")
        torch.save({"losses": self.losses, "step": self.trainer.global_step,
                    "params": {k: v.detach().float().clone() for k, v in self.state_dict().items()}}, path)


def rank_files(out: str, tag: str, world: int) -> list[dict]:
    res = []
    for r in range(world):
        path = os.path.join(out, f"{tag}rank{r}.pt")
        assert os.path.exists(path), f"rank {r} wrote no {path}"
        res.append(torch.load(path, weights_only=False))
    return res


def trainer_kwargs(devices: int, max_steps: int, accum: int = 1, clip: Optional[float] = None, **kw) -> dict:
    base = dict(accelerator="cpu", devices=devices, max_steps=max_steps, accumulate_grad_batches=accum,
                gradient_clip_val=clip, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    base.update(kw)
    return base
