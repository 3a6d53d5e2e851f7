"""``lightning-zero tune --module pkg.mod:factory``: the largest micro-batch of any LightningModule per preset.

Design note
-----------
The recipe tuner (:mod:`.tune`) knows the T5 experiment; this one knows nothing but a factory that returns
a ``LightningModule`` (or ``(module, datamodule)``) whose ``batch_size`` (or ``hparams.batch_size``, or the
datamodule's) sizes its training data. For each chosen preset it runs what a user would:
``Trainer(strategy=<preset>, devices=N, callbacks=[ZeroBatchSizeFinder(max_bytes=cap, ...)]).fit(module)``,
stopped after the search (as Lightning's ``Tuner`` stops its finder). The N ranks are started once
(:func:`..launch.run_ranks`, forked on CPU, spawned on CUDA) and, as under torchrun, every Trainer runs
inside them on the process group they share; each preset gets a fresh module from the factory.

"Fits" is the finder's rule (``engine/memory/step_bytes.py`` on CPU, ``torch.cuda.max_memory_allocated`` on a GPU), the
answer the one all ranks agree on. The winner is the preset with the largest micro-batch (ties: the
earlier preset, which shards less and so communicates less); no timing is done here -- a micro-batch that
fits is what this answers.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..model_sizes import GiB, MiB
from .settings import chosen_settings

_FINDER_KEYS = ("mode", "steps_per_trial", "init_val", "max_trials", "max_val", "batch_arg_name")


def load_factory(spec: str):
    """``pkg.mod:factory`` -> ``(LightningModule, datamodule or None)`` from ``factory()``."""
    from lightning.pytorch import LightningDataModule, LightningModule

    from ..factory import call_factory

    made = call_factory(spec)
    module, data = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    if not isinstance(module, LightningModule) or not (data is None or isinstance(data, LightningDataModule)):
        raise ValueError(f"{spec} returned {type(made).__name__}; allowed: a LightningModule, or a "
                         "(LightningModule, LightningDataModule) pair.")
    return module, data


@dataclass
class PresetBatch:
    setting: str
    status: str  # fits | nothing fits | failed
    batch_size: int = 0
    peak_bytes: Optional[int] = None
    trials: list = field(default_factory=list)  # (batch size, fits, peak bytes, max over ranks)
    reason: str = ""


@dataclass
class ModuleTuneResult:
    spec: str
    budget_bytes: Optional[int]
    world_size: int
    precision: str
    gpu: bool
    results: list[PresetBatch]

    @property
    def best(self) -> Optional[PresetBatch]:
        fits = [r for r in self.results if r.status == "fits"]
        return max(fits, key=lambda r: r.batch_size) if fits else None  # max keeps the first of ties

    def report(self) -> str:
        rule = "GPU: torch.cuda.max_memory_allocated" if self.gpu else "CPU: step bytes (docs/tuning.md)"
        cap = f"{self.budget_bytes / MiB:.2f} MiB" if self.budget_bytes else "the device memory"
        lines = [f"tune --module {self.spec}: {self.world_size} rank(s), precision {self.precision}, cap {cap} "
                 f"per rank ({rule})", "",
                 "| setting       | micro-batch | peak MiB/rank | trials (+ fits, - does not)          | status |",
                 "|---------------|-------------|---------------|--------------------------------------|--------|"]
        for r in self.results:
            trials = " ".join(f"{b}{'+' if ok else '-'}" for b, ok, _ in r.trials)
            peak = f"{r.peak_bytes / MiB:.2f}" if r.peak_bytes is not None else "-"
            status = r.status + (f": {r.reason}" if r.reason else "")
            lines.append(f"| {r.setting:<13} | {r.batch_size or '-':>11} | {peak:>13} | {trials:<36} | {status} |")
        best = self.best
        lines.append("")
        if best is None:
            lines.append(f"NOTHING FITS in {cap} per rank on {self.world_size} rank(s); allowed: a larger cap, more "
                         "ranks with zero3 / zero3_offload, activation_checkpointing, bf16-mixed.")
        else:
            cap_arg = f"max_bytes={self.budget_bytes}" if self.budget_bytes else ""
            lines.append(f"best: {best.setting} at micro-batch {best.batch_size} (the largest; ties: the earlier "
                         f"preset). Train with batch_size={best.batch_size} and strategy=\"{best.setting}\", or "
                         f"keep callbacks=[lightning_zero.ZeroBatchSizeFinder({cap_arg})] to search at fit start.")
        return "\n".join(lines)


def tune_module(spec: str, memory_mb: Optional[float] = None, memory_gb: Optional[float] = None, devices: int = 1,
                stages: Sequence[int] | str = (0, 1, 2, 3), offload: str = "both", precision: str = "32-true",
                accelerator: str = "auto", mode: str = "binsearch", steps_per_trial: int = 3, init_val: int = 2,
                max_trials: int = 25, max_val: int = 8192, batch_arg_name: str = "batch_size",
                start_method: Optional[str] = None, json_out: Optional[str] = None,
                log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> ModuleTuneResult:
    """Per preset of ``stages`` x ``offload``: the micro-batch :class:`~lightning_zero.ZeroBatchSizeFinder`
    finds for ``spec``'s module on ``devices`` ranks under the cap (MiB / GiB per rank; required on CPU)."""
    import torch

    from ...lightning.batch_size_finder import ZeroBatchSizeFinder
    from ..launch import run_ranks

    if memory_mb is not None and memory_gb is not None:
        raise ValueError("Give at most one memory cap: memory_mb or memory_gb.")
    budget = int(memory_mb * MiB) if memory_mb is not None else int(memory_gb * GiB) if memory_gb is not None else None
    gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if budget is None and not gpu:
        raise ValueError("tune --module on CPU needs a cap: --memory-mb or --memory-gb (a CPU has no "
                         "out-of-memory error to probe).")
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices={devices!r}: allowed a positive int (ranks on this node).")
    settings = chosen_settings(stages, offload)
    if not settings:
        raise ValueError(f"No preset matches stages={stages!r} and offload={offload!r}.")
    finder_kw = dict(max_bytes=budget, mode=mode, steps_per_trial=steps_per_trial, init_val=init_val,
                     max_trials=max_trials, max_val=max_val, batch_arg_name=batch_arg_name)
    ZeroBatchSizeFinder(**finder_kw)  # bad arguments fail here, once, not on every rank
    load_factory(spec)  # and a bad factory too
    with tempfile.TemporaryDirectory() as root:
        raw = run_ranks(_rank, devices, (spec, settings, finder_kw, precision, "cuda" if gpu else "cpu", root),
                        start_method=start_method or ("spawn" if gpu else "fork"),
                        backend="nccl" if gpu else "gloo", timeout_s=1800)[0]
    results = [PresetBatch(**r) for r in raw]
    for r in results:
        log(f"  {r.setting}: " + (f"micro-batch {r.batch_size}" if r.status == "fits" else r.status))
    res = ModuleTuneResult(spec, budget, devices, precision, gpu, results)
    if json_out:
        Path(json_out).write_text(json.dumps({"spec": spec, "budget_bytes": budget, "world_size": devices,
                                              "precision": precision, "results": [asdict(r) for r in results],
                                              "best": res.best.setting if res.best else None}, indent=1))
    return res


def _rank(rank: int, world: int, spec: str, settings: list, finder_kw: dict, precision: str, accelerator: str,
          root: str) -> list[dict]:
    """On every rank: one Trainer per preset, stopped after its search; rank 0's list is the answer."""
    from lightning.pytorch import Trainer

    from ...lightning.batch_size_finder import ZeroBatchSizeFinder

    out = []
    for name in settings:
        module, data = load_factory(spec)
        finder = ZeroBatchSizeFinder(**finder_kw)
        finder._early_exit = True  # as Lightning's Tuner: the fit ends with the search
        trainer = Trainer(strategy=name, accelerator=accelerator, devices=world, precision=precision,
                          max_steps=finder_kw["steps_per_trial"], logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                          default_root_dir=root, callbacks=[finder])
        row = {"setting": name, "status": "fits"}
        try:
            trainer.fit(module, datamodule=data)
        except ValueError as err:  # decided on the all-reduced peaks: every rank raises it
            if "nothing fits" not in str(err):
                raise
            row.update(status="nothing fits", reason=str(err).split(": ", 1)[1].split(" (")[0])
        row["trials"] = [list(t) for t in finder.trials]
        if row["status"] == "fits":
            b = finder.optimal_batch_size
            row["batch_size"] = b
            row["peak_bytes"] = max((p for s, ok, p in finder.trials if s == b and ok), default=None)
        out.append(row)
    return out
