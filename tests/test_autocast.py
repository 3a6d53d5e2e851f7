"""bf16-mixed keeps the module in bf16 (ZeRO's memory) yet trains models written for AMP: Lightning's demo
Transformer adds a positional encoding it keeps as a plain fp32 attribute. Compared with fp32 DDP."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer
from lightning.pytorch.demos import Transformer
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset

from lightning_zero import ZeroPrecision, ZeroStrategy

pytestmark = pytest.mark.timeout(120)
VOCAB, SEQ, STEPS = 40, 9, 6


class RandomTokens(Dataset):
    """WikiText2-shaped items (input, target shifted by one), made up, no download."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        row = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(31 * i + 5))
        return row[:-1], row[1:]


class DemoTransformer(pl.LightningModule):
    def __init__(self, out: str, tag: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.0)
        self.out, self.tag, self.losses = out, tag, []

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)  # forked rank: see tests/helpers/lightning_models.py

    def train_dataloader(self):
        return DataLoader(RandomTokens(), batch_size=4)

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        loss = F.nll_loss(self.model(inputs, target), target.reshape(-1))
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)

    def on_train_end(self):
        torch.save(self.losses, os.path.join(self.out, f"{self.tag}_rank{self.global_rank}.pt"))


def _fit(tmp_path, tag, strategy, precision):
    # Lightning turns precision="16-mixed" into bf16 on CPU; the plugin itself keeps fp16
    prec = dict(plugins=[ZeroPrecision("16-mixed", initial_scale_power=8)]) if precision == "16-mixed" \
        else dict(precision=precision)
    Trainer(accelerator="cpu", devices=2, strategy=strategy, **prec, max_steps=STEPS, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(
        DemoTransformer(str(tmp_path), tag))
    return torch.tensor([torch.load(tmp_path / f"{tag}_rank{r}.pt") for r in range(2)])


@pytest.fixture(scope="module")
def ddp_fp32(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("ddp"), "ddp", DDPStrategy(start_method="fork"), "32-true")


@pytest.mark.parametrize("stage,precision", [(1, "bf16-mixed"), (2, "bf16-mixed"), (3, "bf16-mixed"),
                                             (2, "16-mixed")])
def test_demo_transformer_trains_under_mixed_precision(tmp_path, ddp_fp32, stage, precision):
    units = dict(unit_classes=["TransformerEncoderLayer", "TransformerDecoderLayer"], persist_numel=0) \
        if stage == 3 else {}
    losses = _fit(tmp_path, "zero", ZeroStrategy(stage=stage, start_method="fork", **units), precision)
    assert torch.isfinite(losses).all()
    assert ddp_fp32[:, -1].mean() < ddp_fp32[:, 0].mean() - 0.1, "the reference learns"
    diff = (losses - ddp_fp32).abs().max().item()
    print(f"stage {stage}: {precision} vs fp32 DDP, max |loss diff| over {STEPS} steps x 2 ranks = {diff:.4f}")
    assert diff < 2e-2
