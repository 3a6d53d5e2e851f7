"""A LoRA (peft) GPT-2 built from a small config, its base written with ``save_pretrained`` (nothing downloaded):
the model of the trainable-only checkpoint tests. The base is most of the bytes (n_embd 64, vocab 509)."""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
VOCAB, SEQ = 509, 8


def gpt2_config(**kw):
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **kw)


def write_base(path: Path, seed: int = 0) -> Path:
    """A randomly initialized GPT-2 as a save_pretrained directory (model.safetensors + config.json)."""
    torch.manual_seed(seed)
    transformers.GPT2LMHeadModel(gpt2_config()).save_pretrained(str(path))
    return path


def lora_gpt2(base: str, seed: int = 1):
    """The base read with from_pretrained, wrapped by peft: LoRA on every attention and MLP projection."""
    model = transformers.GPT2LMHeadModel.from_pretrained(base)
    torch.manual_seed(seed)  # LoRA's A matrices are drawn here
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_fc"],
                          fan_in_fan_out=True)
    return peft.get_peft_model(model, cfg)


class Steps(Dataset):
    """Only drives the loop: a step's tokens are a function of (step, rank) (:func:`tokens`), so a resumed run
    sees what the uninterrupted one saw whatever the sampler does when Lightning restores it mid-epoch."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return i


def tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1000 * step + rank))


class LoraModule(pl.LightningModule):
    """Records every training loss and, after the fit (the module whole again), its weights."""

    def __init__(self, base: str, out: str = "", tag: str = "") -> None:
        super().__init__()
        self.out, self.tag = out, tag
        self.model = lora_gpt2(base)
        self.losses: list[float] = []

    def setup(self, stage):
        torch.set_num_threads(1)  # a forked rank must not use the parent's OpenMP pool

    def train_dataloader(self):
        return DataLoader(Steps(), batch_size=2, shuffle=False)

    def training_step(self, batch, batch_idx):
        ids = tokens(self.trainer.global_step, self.global_rank)
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9), "interval": "step"}]

    def on_fit_end(self):  # after the strategy's teardown: the module is whole again
        if self.out:
            rank = self.trainer.global_rank
            torch.save(self.losses, os.path.join(self.out, f"{self.tag}losses_rank{rank}.pt"))
            if rank == 0:
                torch.save({k: v.detach().clone() for k, v in self.state_dict().items()},
                           os.path.join(self.out, f"{self.tag}weights.pt"))


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
