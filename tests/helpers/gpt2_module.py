"""A GPT-2 LightningModule from a small config (an HF model the package did not write) and its token data."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

transformers = pytest.importorskip("transformers")
VOCAB, SEQ = 61, 8


def gpt2_config():
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                   eos_token_id=0)


class _Tokens(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(31 * i + 5))


class GPTModule(pl.LightningModule):
    def __init__(self, config: dict, out: str = "", lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))

    def setup(self, stage):
        torch.set_num_threads(1)  # a forked rank must not use the parent's OpenMP pool (see tests/helpers/lightning_models.py)

    def train_dataloader(self):
        return DataLoader(_Tokens(), batch_size=2, shuffle=False)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)]

    def on_fit_end(self):  # after the strategy's teardown: the module is whole again, in fp32
        if self.trainer.is_global_zero and self.hparams.out:
            torch.save({k: v.detach().clone() for k, v in self.state_dict().items()},
                       os.path.join(self.hparams.out, f"weights_step{self.trainer.global_step}.pt"))
