"""1-bit Adam on parameters whose true gradient is zero ([Note: elements without a gradient] in
engine/optim/onebit/base.py): HF GPT-2 built from its config, under the Trainer with Lightning's defaults (2 forked
gloo ranks), the variance frozen at 20% of the run. GPT-2's attention key bias has a zero true gradient
(softmax is shift-invariant): its computed one is rounding noise. Before the rule, the 1-bit momentum gave it
its chunk's scale over a denominator of eps, and it grew to hundreds; AdamW keeps it below 1e-4."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_zero  # noqa: F401  (registers the strategy names, "zero0_fork" among them)

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, STEPS, FREEZE, LR = 64, 16, 4, 50, 10, 1e-3


def _chain(seed: int) -> torch.Tensor:
    """A sequence of one fixed random bigram chain (4 likely successors per token): a learnable stream."""
    nxt = torch.randint(0, VOCAB, (VOCAB, 4), generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    toks = torch.empty(SEQ, dtype=torch.long)
    toks[0] = torch.randint(0, VOCAB, (1,), generator=g)
    for t in range(1, SEQ):
        toks[t] = nxt[toks[t - 1], torch.randint(0, 4, (1,), generator=g)]
    return toks


class _Chains(Dataset):
    def __len__(self):
        return 4 * STEPS * BATCH

    def __getitem__(self, i):
        return _chain(i)


class KeyBiasModule(pl.LightningModule):
    def __init__(self, out: str, optimizer: str) -> None:
        super().__init__()
        self.out, self.optimizer_name = out, optimizer
        torch.manual_seed(0)
        self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))

    def setup(self, stage):
        torch.set_num_threads(1)  # a forked rank must not use the parent's OpenMP pool

    def train_dataloader(self):
        return DataLoader(_Chains(), batch_size=BATCH, shuffle=False)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        from lightning_zero.optim import OneBitAdam, ZeroOneAdam

        if self.optimizer_name == "onebit":
            return OneBitAdam(self.parameters(), lr=LR, freeze_step=FREEZE)
        if self.optimizer_name == "zeroone":
            return ZeroOneAdam(self.parameters(), lr=LR, var_freeze_step=FREEZE)
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)

    def on_train_end(self):
        if not self.trainer.is_global_zero:
            return
        n = self.model.config.n_embd
        key_bias = max(h.attn.c_attn.bias[n: 2 * n].abs().max().item() for h in self.model.transformer.h)
        others = max(p.abs().max().item() for name, p in self.model.named_parameters() if "c_attn.bias" not in name)
        with torch.no_grad():
            held_out = torch.stack([_chain(-1 - i) for i in range(16)])
            val = self.model(input_ids=held_out, labels=held_out).loss.item()
        torch.save({"key_bias": key_bias, "others": others, "val": val},
                   os.path.join(self.out, f"{self.optimizer_name}.pt"))


def _fit(out: str, optimizer: str, strategy: str = "zero0_fork") -> dict:
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(
        KeyBiasModule(out, optimizer))
    return torch.load(os.path.join(out, f"{optimizer}.pt"), weights_only=True)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy,optimizer", [("zero0_fork", "onebit"), ("zero1_fork", "onebit"),
                                                ("zero0_fork", "zeroone")])
def test_key_bias_stays_bounded_under_compressed_adam(tmp_path, strategy, optimizer):
    """After 40 compressed steps the key bias stays within AdamW's own range (< 1e-3; AdamW < 1e-4; before
    the rule 1-bit Adam's reached 180, 0/1 Adam's 292), every other weight and the held-out loss within AdamW's
    reach (the elements left out are the ones without a gradient; 1-bit Adam's loss as before: 3.4711 -> 3.4686)."""
    adamw = _fit(str(tmp_path), "adamw")
    onebit = _fit(str(tmp_path), optimizer, strategy)
    print(f"key bias: AdamW {adamw['key_bias']:.3g}, {optimizer} {onebit['key_bias']:.3g}; held-out loss: AdamW "
          f"{adamw['val']:.4f}, {optimizer} {onebit['val']:.4f}; other weights: {adamw['others']:.3g}, "
          f"{onebit['others']:.3g}")
    assert adamw["key_bias"] < 1e-4
    assert onebit["key_bias"] < 1e-3
    assert onebit["others"] < 2 * adamw["others"]
    assert onebit["val"] < 1.02 * adamw["val"]
