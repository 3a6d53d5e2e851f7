"""bf16 optimizer states (``optimizer_state_dtype="bf16"``, ``master_dtype="bf16"``): a tiny LightningModule, its
data as Lightning's sampler splits it over 2 ranks, and a one-process reference of the algorithm written from
its definition -- never by calling lightning_zero:

* the fp32 value of a parameter is ``x = hi + lo`` (``hi``: the bf16 parameter, ``lo``: a bf16 compensation);
  at setup ``hi = bf16(x0)`` (to nearest), ``lo = bf16(x0 - hi)`` rounded toward zero (so ``|lo|`` stays below
  half an ulp of ``hi`` and a load's split of ``hi + lo`` gives back the same ``hi``);
* each step torch's AdamW runs on fp32 copies ``x`` with the moments widened from bf16 to fp32; after it
  ``hi = bf16(x)``, ``lo = bf16(x - hi)`` as at setup and the moments are rounded back to bf16 (to nearest);
* the gradient is the bf16 mixed-precision one of each rank (forward under bf16 autocast on the bf16 module),
  reduced as ZeRO reduces it in bf16 (each rank's bf16 gradient halved, the two summed in fp32 and rounded to
  bf16: every micro-batch at stages 2-3, the micro-batches first summed on the rank in bf16 at stage 1), then
  clipped by the global norm in fp32 (DDP's coefficient ``max / (norm + 1e-6)``).

The engine sums its shards' squares, the reference whole gradients': the two norms agree to fp32 rounding, not
in every bit, and an ulp in the clip coefficient can flip a rounding of ``hi`` / ``lo``. So the reference takes
the run's norm for the coefficient (``norms``) after the test checked it against its own (``ref_norms``); with
that every other bit is the algorithm's.
"""

from __future__ import annotations

import os
from typing import Optional

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

BF16 = torch.bfloat16
WORLD, BATCH, ACCUM, CLIP = 2, 4, 2, 0.5
N_ITEMS = WORLD * BATCH * ACCUM * 2  # one epoch = 2 optimizer steps: a resume starts at an epoch boundary
LR, WD = 2e-3, 0.01


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 24), nn.Linear(24, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def make_net() -> TinyNet:
    torch.manual_seed(0)
    return TinyNet()


def item(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(6, generator=g)
    return x, torch.sin(3 * x[:3]) + 0.1 * torch.randn(3, generator=g)


class Items(Dataset):
    def __len__(self) -> int:
        return N_ITEMS

    def __getitem__(self, i):
        return (*item(i), i)


def micro_batch_items(rank: int, n: int) -> list[int]:
    """Rank ``rank``'s ``n``-th micro-batch of the fit: the DistributedSampler Lightning puts in gives it
    ``randperm(N_ITEMS)[rank::WORLD]`` of the epoch (seed 0 + epoch); the DataLoader cuts batches of BATCH."""
    per_epoch = N_ITEMS // (WORLD * BATCH)
    epoch, k = divmod(n, per_epoch)
    order = torch.randperm(N_ITEMS, generator=torch.Generator().manual_seed(epoch)).tolist()[rank::WORLD]
    return order[k * BATCH:(k + 1) * BATCH]


def micro_batch(rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(item(i) for i in micro_batch_items(rank, n)))
    return torch.stack(xs), torch.stack(ys)


def lr_at(step: int) -> float:
    return LR * min(1.0, (step + 1) / 2)  # one warmup step, then constant


def make_optimizer(params):
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s) / LR)


class LowPrecisionModule(pl.LightningModule):
    """TinyNet + AdamW + the warmup schedule; every rank writes its losses at the end of each fit, and rank 0
    the run's state: fp32 masters, the optimizer state and the bf16 parameters."""

    def __init__(self, out: str, tag: str) -> None:
        super().__init__()
        self.net = make_net()
        self.out, self.tag = out, tag
        self.losses: list[float] = []
        self.seen: list[list[int]] = []  # each micro-batch's items: the reference assumes Lightning's sampler
        self.norms: list[float] = []  # each step's global gradient norm, as the clipping that follows reads it
        self.master_dtypes: list = []  # (global step, the masters' dtypes) after each batch

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)  # a forked rank must not use the parent's OpenMP pool (lightning_models.py)

    def train_dataloader(self):
        return DataLoader(Items(), batch_size=BATCH, shuffle=False)

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().float().item())
        self.seen.append(idx.tolist())
        return loss

    def on_before_optimizer_step(self, optimizer):
        # the engine's global norm of this step (computed once and cached: Lightning's clipping reads the same)
        self.norms.append(float(self.trainer.strategy.engine.global_grad_norm()))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.master_dtypes.append((self.global_step, master_dtypes(self.trainer.strategy.engine)))

    def configure_optimizers(self):
        opt, sched = make_optimizer(self.net.parameters())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_end(self):
        engine = self.trainer.strategy.engine
        result = run_state(engine, self.net, self.trainer.strategy.gathered_params)
        result.update(losses=list(self.losses), seen=list(self.seen), norms=list(self.norms),
                      master_dtypes=self.master_dtypes, global_step=self.global_step)
        torch.save(result, os.path.join(self.out, f"{self.tag}rank{self.global_rank}.pt"))


def master_dtypes(engine) -> set[torch.dtype]:
    """The dtypes the engine's masters have now: bf16 alone between steps (an fp32 one is 4 more bytes)."""
    return {m.dtype for s in engine.shardeds for row in s.masters for m in row}


def run_state(engine, net: nn.Module, gathered) -> dict:
    """What a run ends with, read through the engine's whole views (collective): the fp32 masters
    (``hi + lo``, exact), the optimizer's state as a plain AdamW saves it, and the bf16 parameters."""
    names = [n for n, _ in net.named_parameters()]
    masters = {n.removeprefix("net."): m.detach().clone()  # the LightningModule's names: net.fc1.weight
               for n, m in zip(engine.param_names(), engine.full_master_params())}
    opt_state = engine.optimizer_state_dict()
    with gathered():
        params = {n: p.detach().clone() for n, p in net.named_parameters()}
    moments = {}
    if opt_state:  # rank 0 holds the whole state; keyed by parameter index in the optimizer's order
        for i, n in enumerate(names):
            st = opt_state["state"][i]
            moments[n] = {k: st[k].detach().clone() for k in ("exp_avg", "exp_avg_sq")}
    return dict(masters={n: masters[n] for n in names}, moments=moments, params=params)


# -- the one-process reference ---------------------------------------------------------------------------
def reference(stage: int, steps: int, norms: Optional[list[float]] = None, compensation: bool = True,
              bf16_moments: bool = True, fused: bool = False) -> dict:
    """``steps`` optimizer steps of the algorithm (module docstring) for ZeRO ``stage``, clipping with the
    global norms ``norms`` (default: its own); ``compensation`` / ``bf16_moments`` False give the variants a
    defect would produce (a plain bf16 master, fp32 moments). ``fused``: torch's fused AdamW kernel, the one
    an offloaded optimizer steps with on the host (its arithmetic differs from the default's in the last bit)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank: the same kernels, the same bits
    try:
        return _reference(stage, steps, norms, compensation, bf16_moments, fused)
    finally:
        torch.set_num_threads(threads)


def _reference(stage: int, steps: int, norms: Optional[list[float]], compensation: bool, bf16_moments: bool,
               fused: bool) -> dict:
    net = make_net()
    names = [n for n, _ in net.named_parameters()]
    x = {n: p.detach().float().clone() for n, p in net.named_parameters()}
    hi = {n: v.to(BF16) for n, v in x.items()}
    lo = {n: _toward_zero(v - hi[n].float()) if compensation else torch.zeros_like(hi[n]) for n, v in x.items()}
    bf16_net = make_net().to(BF16)
    moments: dict[str, dict[str, torch.Tensor]] = {}
    losses: list[list[float]] = [[] for _ in range(WORLD)]
    ref_norms: list[float] = []
    for step in range(steps):
        with torch.no_grad():
            for n, p in bf16_net.named_parameters():
                p.copy_(hi[n])
        reduced: dict[str, Optional[torch.Tensor]] = dict.fromkeys(names)
        local = [dict.fromkeys(names) for _ in range(WORLD)]
        for micro in range(ACCUM):
            grads = []
            for rank in range(WORLD):
                xb, yb = micro_batch(rank, step * ACCUM + micro)
                bf16_net.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=BF16):
                    loss = nn.functional.mse_loss(bf16_net(xb.to(BF16)), yb.to(BF16))
                losses[rank].append(loss.float().item())
                (loss / ACCUM).backward()
                grads.append({n: p.grad.clone() for n, p in bf16_net.named_parameters()})
            for rank in range(WORLD):
                for n in names:  # stage 1 accumulates the micro-batches on the rank (autograd, bf16)
                    g = grads[rank][n]
                    local[rank][n] = g if local[rank][n] is None else local[rank][n] + g
            if stage >= 2:  # every micro-batch reduced; the reduced micro-batches summed in bf16
                for n in names:
                    red = _reduce([grads[r][n] for r in range(WORLD)])
                    reduced[n] = red if reduced[n] is None else reduced[n] + red
        if stage == 1:
            reduced = {n: _reduce([local[r][n] for r in range(WORLD)]) for n in names}
        g32 = {n: reduced[n].float() for n in names}
        ref_norms.append(float(torch.stack([g.norm() for g in g32.values()]).norm()))
        norm = norms[step] if norms is not None else ref_norms[-1]
        coef = min(1.0, CLIP / (norm + 1e-6))
        # AdamW on fp32 copies: x = hi + lo, the moments widened
        w = {n: nn.Parameter(hi[n].float() + lo[n].float()) for n in names}
        opt = torch.optim.AdamW([w[n] for n in names], lr=lr_at(step), weight_decay=WD, fused=fused or None)
        if coef != 1.0:
            torch._foreach_mul_(list(g32.values()), coef)
        for n in names:
            w[n].grad = g32[n]
            if n in moments:
                opt.state[w[n]] = {k: (v.float() if torch.is_tensor(v) and v.dim() else v.clone())
                                   for k, v in moments[n].items()}
        opt.step()
        for n in names:
            v = w[n].detach()
            hi[n] = v.to(BF16)
            lo[n] = _toward_zero(v - hi[n].float()) if compensation else torch.zeros_like(hi[n])
            st = opt.state[w[n]]
            moments[n] = {k: (t.to(BF16) if bf16_moments and t.dim() else t.clone()) for k, t in st.items()}
    return dict(masters={n: hi[n].float() + lo[n].float() for n in names}, params=hi, losses=losses, norms=ref_norms,
                moments={n: {k: moments[n][k] for k in ("exp_avg", "exp_avg_sq")} for n in names})


def _toward_zero(d: torch.Tensor) -> torch.Tensor:
    """bf16 of an fp32 tensor rounded toward zero: its low 16 bits cut."""
    return (d.view(torch.int32) & -65536).view(torch.float32).to(BF16)


def _reduce(grads: list[torch.Tensor]) -> torch.Tensor:
    """ZeRO's bf16 reduction of the ranks' gradients: each halved (in bf16), summed in fp32 in rank order,
    rounded to bf16 (the reduce dtype is the compute dtype by default)."""
    acc = (grads[0] / WORLD).float()
    for g in grads[1:]:
        acc = acc + (g / WORLD).float()
    return acc.to(BF16)
