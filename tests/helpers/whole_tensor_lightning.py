"""LightningModules for the whole-tensor optimizer tests under the Trainer (tests/test_whole_tensor_lightning.py):
the Muon + AdamW split in manual optimization, Adafactor in automatic optimization, Adafactor unfreezing
through BaseFinetuning; each rank writes its losses, norms, optimizer step counts and final weights.

Muon's Newton-Schulz runs in bf16 in torch, so a last-bit difference of a gradient (another summation order)
moves weights by ~1e-4; ``fp32_newton_schulz`` is torch's iteration computed in fp32, patched into both runs
for the fp32 rtol 1e-5 comparisons.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import BaseFinetuning
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_zero import muon_split
from tests.helpers.whole_tensor_runs import newton_schulz_fp32
from tests.helpers.lightning_models import TokenDataset, _params, load_rank_files, trainer_kwargs, uses_sometimes
from tests.helpers.models import VOCAB, loss_fn, make_model

CLIP = 0.5


fp32_newton_schulz = newton_schulz_fp32  # torch's Muon iteration in fp32 (whole_tensor_runs.py)


class MuonNet(nn.Module):
    """Embedding, hidden matrices, a LayerNorm and an untied head: every module has ``reset_parameters``, so a
    meta build (``configure_model`` at stage 3) materializes it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 12), nn.LayerNorm(12), nn.Linear(12, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, tokens, use_sometimes: bool = False):
        h = self.emb(tokens)
        return self.head(h + self.fc2(torch.tanh(self.norm(self.fc1(h)))))


def count_steps(optimizer: torch.optim.Optimizer, counts: list) -> None:
    """``counts[0]`` += 1 after every ``optimizer.step()`` (its own class's, however the call reaches it)."""
    counts.append(0)
    k = len(counts) - 1

    def hook(opt, args, kwargs):
        counts[k] += 1

    optimizer.register_step_post_hook(hook)


class _Recorder(pl.LightningModule):
    def __init__(self, out: str, tag: str) -> None:
        super().__init__()
        self.out, self.tag = out, tag
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.step_counts: list[int] = []

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)  # forked ranks must not use OpenMP pools (tests/helpers/lightning_models.py)

    def train_dataloader(self):
        return DataLoader(TokenDataset(64), batch_size=4, shuffle=False)

    def val_dataloader(self):
        return DataLoader(TokenDataset(12), batch_size=3, shuffle=False)

    def validation_step(self, batch, batch_idx):
        loss = loss_fn(self.net, batch[0], False)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def _dump(self, what: str, **extra) -> None:
        torch.save({"losses": list(self.losses), "norms": list(self.norms), "params": _params(self),
                    "step_counts": list(self.step_counts), "global_step": self.global_step, **extra},
                   os.path.join(self.out, f"{self.tag}{what}_rank{self.global_rank}.pt"))

    def on_train_end(self) -> None:
        self._dump("train")


class MuonAdamW(_Recorder):
    """The split users write: Muon on ``muon_split``'s hidden matrices, AdamW on the rest, an LR schedule on
    each, manual optimization clipping both by one global norm as a DDP user does it."""

    def __init__(self, out: str, tag: str, deferred: bool = False, clip: bool = True) -> None:
        super().__init__(out, tag)
        self.deferred, self.clip = deferred, clip
        torch.manual_seed(0)
        self.net = None if deferred else make_model()
        self.automatic_optimization = False

    def configure_model(self) -> None:
        if self.net is None:  # on the meta device under ZeroStrategy(stage=3)
            torch.manual_seed(0)
            self.net = MuonNet()
            self.built_on_meta = all(p.is_meta for p in self.net.parameters())

    def configure_optimizers(self):
        hidden, rest = muon_split(self)
        muon = torch.optim.Muon(hidden, lr=2e-2, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
        adamw = torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.01, eps=1e-2)  # eps: its step feels the clip
        for opt in (muon, adamw):
            count_steps(opt, self.step_counts)
        scheds = [torch.optim.lr_scheduler.LambdaLR(muon, lambda s: 1.0 / (1.0 + s)),
                  torch.optim.lr_scheduler.StepLR(adamw, step_size=1, gamma=0.7)]
        return [muon, adamw], scheds

    def training_step(self, batch, batch_idx):
        muon, adamw = self.optimizers()
        loss = loss_fn(self.net, batch[0], uses_sometimes(self.global_rank, self.global_step))
        self.manual_backward(loss)
        if self.clip:  # DDP's line: one norm over both optimizers' gradients
            self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.parameters(), CLIP)))
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
        for sched in self.lr_schedulers():
            sched.step()
        self.log("train_loss", loss, sync_dist=True)
        self.losses.append(loss.item())

    def on_train_end(self) -> None:
        self._dump("train", meta=getattr(self, "built_on_meta", None),
                   lrs=[opt.param_groups[0]["lr"] for opt in self.trainer.optimizers],
                   logged=float(self.trainer.callback_metrics["train_loss"]))


class AdafactorAuto(_Recorder):
    """Adafactor alone, automatic optimization: Lightning's ``gradient_clip_val`` and ``accumulate_grad_batches``."""

    def __init__(self, out: str, tag: str) -> None:
        super().__init__(out, tag)
        torch.manual_seed(0)
        self.net = make_model()

    def configure_optimizers(self):
        opt = torch.optim.Adafactor(self.parameters(), lr=1e-2)
        count_steps(opt, self.step_counts)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)}

    def training_step(self, batch, batch_idx):
        loss = loss_fn(self.net, batch[0], uses_sometimes(self.global_rank, self.global_step))
        self.losses.append(loss.item())
        return loss

    def on_train_end(self) -> None:
        opt = self.trainer.optimizers[0]
        steps = sorted({float(st["step"]) for st in opt.state.values() if "step" in st})  # owned parameters only
        self._dump("train", state_steps=steps)


class AdafactorFinetuned(_Recorder):
    """``net.fc1`` frozen until epoch 1, then unfrozen into the Adafactor (BaseFinetuning's add_param_group)."""

    def __init__(self, out: str, tag: str, batch_size: int) -> None:
        super().__init__(out, tag)
        torch.manual_seed(0)
        self.net = make_model()
        self.batch_size = batch_size

    def train_dataloader(self):
        if self.trainer.world_size > 1:  # Lightning puts a shuffling DistributedSampler (seed 0) in
            return DataLoader(TokenDataset(16), batch_size=self.batch_size)
        # the reference: the same permutation (seed and epoch only), so a global batch is the ranks' two
        return DataLoader(TokenDataset(16), batch_size=self.batch_size,
                          sampler=DistributedSampler(TokenDataset(16), num_replicas=1, rank=0, shuffle=True, seed=0))

    def configure_optimizers(self):
        return torch.optim.Adafactor([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def training_step(self, batch, batch_idx):
        loss = loss_fn(self.net, batch[0], False)
        self.losses.append(loss.item())
        return loss


class UnfreezeFc1(BaseFinetuning):
    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.net.fc1)

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.net.fc1, optimizer, lr=5e-3, train_bn=False)


def fit(module: pl.LightningModule, strategy, devices: int = 2, **kw) -> list[dict]:
    """``module`` fitted under ``strategy`` (a fork launcher): each rank's record."""
    kw = {**trainer_kwargs(devices=devices), **kw}
    # Lightning leaves MASTER_PORT set in this process and the next fit would reuse it: on a busy machine another
    # process may hold it by then (EADDRINUSE); each fit takes a free port of its own
    os.environ.pop("MASTER_PORT", None)
    Trainer(strategy=strategy, **kw).fit(module)
    return load_rank_files(module.out, module.tag, "train", devices)


def fit_validate_fit(rank: int, world_size: int, name: str, out: str) -> dict:
    """In a launched rank (its process group made, as under torchrun): fit, validate, fit again, validate,
    with ``name``'s strategy ("ddp" or a ZeroStrategy preset); what the user sees after each."""
    from lightning.pytorch.strategies import DDPStrategy
    from tests.helpers.lifecycle_harness import trainer, whole_params

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", LOCAL_WORLD_SIZE=str(world_size))
    make = (lambda: DDPStrategy(find_unused_parameters=True)) if name == "ddp" else (lambda: name)
    model = MuonAdamW(out, f"{name}_seq_")
    record: dict = {"metrics": []}
    before = tracked_engines()
    for k in (1, 2):
        t = trainer(make(), world_size, 4)
        t.fit(model)
        record[f"weights{k}"] = whole_params(model, t.strategy)
        record["metrics"].append(t.validate(model))
    record.update(losses=model.losses, norms=model.norms, step_counts=model.step_counts,
                  torch_clip_restored=routes_released(before))
    return record


def tracked_engines() -> set:
    """The engines torch's clipping is routed to in this process now (engine/grads/clip_routes.py)."""
    from lightning_zero.engine.grads import clip_routes

    return {id(e) for e in clip_routes._ENGINES}


def routes_released(before: set) -> bool:
    """No engine made since ``before`` is still routed to, and torch's own function is back unless an engine
    from before (one this forked rank inherited) still trains."""
    from lightning_zero.engine.grads import clip_routes

    now = tracked_engines()
    return now <= before and (bool(now) or torch.nn.utils.clip_grad_norm_ is clip_routes._TORCH["clip_grad_norm_"])


torch_clip_bound_at_import = torch.nn.utils.clip_grad_norm_  # what `from torch.nn.utils import ...` binds early
