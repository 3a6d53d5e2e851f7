"""The measuring harness shared by the benchmarks (bench/) and the autotuner: runners, the multi-process
launcher, saved-activation bytes, and the largest-micro-batch search with timing.

Design note
-----------
Moved here from ``bench/harness.py`` and ``bench/seed_table.py`` (which import it back) so that the
installed ``lightning-zero tune`` command measures with the very code the benchmark tables use.

* :class:`Runner`: one method built on one rank (the object a Lightning strategy would drive) and its
  model-state byte accounting (``engine.memory_report()`` for ours).
* :class:`Trial`: one candidate on one rank, built lazily and rebuilt after an out-of-memory error;
  :meth:`Trial.probe` runs one real training step at a micro-batch and says whether it fits on every
  rank. GPU: a real ``torch.OutOfMemoryError`` under ``torch.cuda.set_per_process_memory_fraction``,
  peak = ``max_memory_allocated``. CPU: a byte budget checked against the measured peak = device-side
  model states (minus offloaded bytes, plus stage 3's peak of gathered units) + the bytes autograd
  saves during the forward (:class:`SavedBytes`; with ``offload_activations`` the offloaded ones are host
  bytes) + with activation checkpointing the largest recompute's saves in backward (``measure_recompute``).
* :func:`search`: doubling from ``start_batch`` until a probe fails, then bisection; :func:`timed`: the
  wall time (max over ranks) of training / evaluating a number of samples at a micro-batch.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...engine import ZeroEngine
from ...engine.memory.activations import SavedBytes, measure_recompute  # noqa: F401 (SavedBytes: re-exported)
from ..launch import run_ranks
from ...engine.placement.placement import Location, Placement
from ...engine.memory.step_bytes import engine_memory, step_device_bytes

# the peers' placements (bench/peers.py): FSDP2 with CPUOffloadPolicy keeps every model state in host memory
PEER_PLACEMENTS = {"fsdp2_offload": Placement(param_shards=Location.HOST, optimizer_states=Location.HOST,
                                              grad_shards=Location.HOST)}


# -- runners ----------------------------------------------------------------------------------------------
def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor -> this rank's shard


def _state_tensors(state: dict) -> list[torch.Tensor]:
    return [_local(v) for st in state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]


class Runner:
    """One method built on one rank: ``module`` is what forward is called on; ``step()`` after backward."""

    def __init__(self, method: str, model: nn.Module, module: nn.Module, opt, engine: Optional[ZeroEngine] = None):
        self.method, self.model, self.module, self.opt, self.engine = method, model, module, opt, engine
        self.numel = sum(p.numel() for p in model.parameters())  # set before stage 3 frees the params

    def pre(self) -> None:
        if self.engine is not None:
            self.engine.sync_buffers()  # ZeroStrategy.training_step does this (DDP broadcasts in forward)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()  # DDP: bucketed all-reduce; zero0: all-reduce; zero1-3 / FSDP2: reduce-scatter

    def step(self) -> None:
        if self.engine is not None:
            self.engine.step()
        else:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def measure_memory(self, loss_closure: Callable[[nn.Module], torch.Tensor]) -> dict:
        """Model-state bytes on this rank after a backward, before the step (optimizer state present)."""
        self.pre()
        self.backward(loss_closure(self.module))
        mem = self.state_bytes()
        self.zero_grad()
        return mem

    def state_bytes(self, finalize: bool = True) -> dict:
        """Model-state bytes held now (call after a backward, before the step, for the peak).

        Ours: ``engine.memory_report()`` (+ stage 3's ``peak_gathered``); FSDP2: local shards of the DTensor
        params, grads and optimizer state; DDP / ZeRO-Opt: params, ``.grad`` and (local) optimizer state.
        ``finalize=False`` between accumulated micro-batches (finalizing would reduce them early).
        """
        if self.engine is not None:
            return engine_memory(self.engine, finalize)
        params = list(self.model.parameters())
        opt_state = self.opt.optim.state if self.method == "zero_opt" else self.opt.state
        mem = {
            "params": _nbytes(_local(p) for p in params),
            "grads": _nbytes(_local(p.grad) for p in params if p.grad is not None),
            "grad_shards": 0,
            "master": 0,
            "optimizer_state": _nbytes(_state_tensors(opt_state)),
            "host": 0,
        }
        mem["model_states"] = mem["params"] + mem["grads"] + mem["optimizer_state"]
        placement = PEER_PLACEMENTS.get(self.method, Placement())
        booked = placement.book(param_shards=mem["params"], grad_shards=mem["grads"],
                                optimizer_states=mem["optimizer_state"])
        mem["host"] = int(booked[Location.HOST])
        return mem

    def zero_grad(self) -> None:
        if self.engine is not None:
            self.engine.zero_grad()
        else:
            self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.remove()


# -- launcher -----------------------------------------------------------------------------------------------
def _entry(rank: int, world_size: int, body: Callable, args) -> Any:
    return body(rank, args)


def launch(body: Callable, args, world_size: int = 2, start_method: str = "spawn") -> dict:
    """Run ``body(rank, args)`` on ``world_size`` ranks (:func:`..launch.run_ranks`); return rank 0's result.

    ``start_method="fork"`` starts in well under a second (tests, CPU); "spawn" is safe with CUDA.
    """
    return run_ranks(_entry, world_size, (body, args), start_method=start_method,
                     backend=getattr(args, "backend", "gloo"), threads=getattr(args, "threads", 1) or 1,
                     timeout_s=300)[0]


# -- measuring a training step ---------------------------------------------------------------------------
def t5_batch(args, rank: int, step: int, b: int, device) -> dict:
    """Synthetic seq2seq batch: ``b`` rows of ``args.src_len`` / ``args.tgt_len`` random tokens (per rank, step)."""
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    x = torch.randint(2, args.vocab, (b, args.src_len), generator=g)
    y = torch.randint(2, args.vocab, (b, args.tgt_len), generator=g)
    return {"input_ids": x.to(device), "attention_mask": torch.ones_like(x).to(device), "labels": y.to(device)}


def oom_types() -> tuple:
    return tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
                 if t is not None)


def _hf_loss(module: nn.Module, batch: dict) -> torch.Tensor:
    return module(**batch).loss


class Trial:
    """One candidate on one rank: built lazily, rebuilt after an OOM (its state may be half-updated then).

    ``build_fn()`` returns a fresh :class:`Runner`; ``batch_fn(rank, step, b, device)`` a batch of ``b``
    samples (different per rank and step); ``loss_fn(module, batch)`` the loss (default: HF ``.loss``).
    ``args`` needs ``budget_bytes`` (CPU byte budget per rank); ``args.accumulate`` (default 1) micro-batches
    make one step, all but the last inside ``engine.no_sync()`` as Lightning runs them.
    """

    def __init__(self, method: str, args, rank: int, device, build_fn: Callable[[], Runner],
                 batch_fn: Callable, autocast: Optional[torch.dtype] = None,
                 loss_fn: Callable = _hf_loss) -> None:
        self.method, self.args, self.rank, self.device = method, args, rank, device
        self.build_fn, self.batch_fn, self.autocast, self.loss_fn = build_fn, batch_fn, autocast, loss_fn
        self.runner: Optional[Runner] = None
        self.gpu = device.type == "cuda"

    def amp(self):
        dt = self.autocast
        return torch.autocast(self.device.type, dtype=dt) if dt is not None else contextlib.nullcontext()

    def batch(self, step_index: int, b: int) -> dict:
        return self.batch_fn(self.rank, step_index, b, self.device)

    def ensure(self) -> None:
        if self.runner is None:
            self.runner = self.build_fn()
            self.step(1, step_index=0)  # materializes the optimizer state (and stage 3's recorded order)

    def drop(self) -> None:
        self.runner = None
        gc.collect()
        if self.gpu:
            torch.cuda.empty_cache()

    def step(self, b: int, step_index: int, measure: bool = False) -> int:
        """One training step at micro-batch ``b``; returns this rank's peak bytes if ``measure``."""
        r = self.runner
        if self.gpu and measure:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        accumulate = max(1, getattr(self.args, "accumulate", 1))
        peak = 0
        for micro in range(accumulate):
            batch = self.batch(step_index * accumulate + micro, b)
            last = micro == accumulate - 1
            saved = SavedBytes(r.model.parameters()) if measure and not self.gpu else None
            sync = r.engine.no_sync() if (r.engine is not None and not last) else contextlib.nullcontext()
            r.pre()
            with sync:
                with self.amp(), (saved.hooks() if saved else contextlib.nullcontext()):
                    loss = self.loss_fn(r.module, batch)
                # checkpointed regions: what one recompute holds in backward, on top of the forward's saves
                with measure_recompute() if saved else contextlib.nullcontext() as recompute:
                    r.backward(loss if accumulate == 1 else loss / accumulate)
            if saved is not None:
                mem = r.state_bytes(finalize=last)
                peak = max(peak, step_device_bytes(mem, saved.bytes + recompute.peak))  # the rule of step_bytes.py
        r.step()
        if self.gpu and measure:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        return peak

    def probe(self, b: int, step_index: int) -> tuple[bool, int]:
        """Does micro-batch ``b`` fit on every rank? (fits, max peak bytes over ranks)."""
        oom = 0
        peak = 0
        try:
            self.ensure()
            peak = self.step(b, step_index, measure=True)
        except oom_types():
            oom = 1
        if oom:
            self.drop()
        flags = torch.tensor([oom, peak], dtype=torch.float64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        oom, peak = int(flags[0]), int(flags[1])
        fits = not oom and (self.gpu or peak <= self.args.budget_bytes)
        return fits, peak


def search(trial: Trial, args, log) -> dict:
    """Largest micro-batch that fits: doubling from ``args.start_batch``, then bisection (``args.bisect_tol``)."""
    probes: list[tuple[int, bool, int]] = []
    ok, fail, b, idx = 0, None, max(1, min(args.start_batch, args.max_batch)), 1
    peak_at = {}
    while True:
        fits, peak = trial.probe(b, idx)
        idx += 1
        probes.append((b, fits, peak))
        if not fits:
            fail = b
            break
        ok, peak_at[b] = b, peak
        if b >= args.max_batch:
            break
        b = min(2 * b, args.max_batch)
    while fail is not None and fail - ok > max(1, int(ok * args.bisect_tol)):
        mid = (ok + fail) // 2
        fits, peak = trial.probe(mid, idx)
        idx += 1
        probes.append((mid, fits, peak))
        if fits:
            ok, peak_at[mid] = mid, peak
        else:
            fail = mid
    log(f"  {trial.method}: probes " + " ".join(f"{b}{'+' if f else '-'}" for b, f, _ in probes) + f" -> {ok}")
    return {"max_batch": ok, "first_fail": fail, "peak_bytes": peak_at.get(ok), "probes": probes}


def timed(trial: Trial, args, b: int, world: int, train: bool) -> float | None:
    """Seconds (max over ranks) to train on / evaluate ``args.train_samples`` / ``args.eval_samples`` at batch b."""
    n = args.train_samples if train else args.eval_samples
    steps = max(1, math.ceil(n / (b * world)))
    err = 0
    try:
        trial.ensure()  # a rebuild after the search's last OOM is not part of the timed work
    except oom_types():
        err = 1
        trial.drop()
    dist.barrier()
    t0 = time.perf_counter()
    try:
        if err:
            raise torch.OutOfMemoryError("rebuild failed")
        r = trial.runner
        if train:
            for i in range(steps):
                trial.step(b, 10_000 + i)
        else:
            r.module.eval()
            with torch.no_grad(), trial.amp():
                for i in range(steps):
                    if r.engine is not None:
                        r.engine.prepare_forward()
                    trial.loss_fn(r.module, trial.batch(20_000 + i, b)).item()
            r.module.train()
        if trial.gpu:
            torch.cuda.synchronize()
    except oom_types():
        err = 1
        trial.drop()
    dt = torch.tensor([time.perf_counter() - t0, err], dtype=torch.float64, device=trial.device)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return None if dt[1] else float(dt[0])


def machine_line() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"torch {torch.__version__}; {os.cpu_count()} CPUs; 1-min load avg at end {load:.1f}"
            + (f"; GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
