"""Autotuner: the fastest ZeRO stage x offload x micro-batch that fits a memory cap, measured.

Design note
-----------
Input is the Hydra experiment of the T5 recipe (``conf/t5_finetune.yaml`` + overrides), so the tuner
measures exactly the model, strategy fields (bucket size, stage-3 units, ...), precision, sequence lengths
and rank count the recipe would run. For every candidate setting (a ``conf/strategy`` preset):

1. the estimator's device model states (a lower bound of the measured peak) are checked against the cap;
   a candidate whose states alone exceed it is rejected without running;
2. the benchmark harness (:mod:`.harness`, shared with ``bench/seed_table.py``) finds the largest
   micro-batch that fits: one real training step per probe, doubling then bisection; GPU: a real
   out-of-memory error under ``torch.cuda.set_per_process_memory_fraction``; CPU: the measured peak
   (device-side model states + saved activations + stage 3's gathered units) against a byte budget;
3. a few training steps at that micro-batch are timed (max over ranks): samples/s = micro-batch x ranks
   x steps / seconds.

Candidates are ranked by samples/s; the winner is written as Hydra overrides, one per line (the user's
overrides minus the ones the tuner decides, then ``strategy=<preset>`` and ``data.batch_size=<b>``), so
``python examples/t5_finetune.py $(cat tuned.overrides)`` runs it. The file is composed once before
being written: the recipe is known to accept it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..estimate import PRECISIONS, estimate_model_states
from ..estimate_states import SETTING_PLANS, SETTINGS, plan_state_bytes
from ..model_sizes import GiB, MiB, info_from_t5
from ..t5_dims import t5_dims_from_config
from ...engine.memory.floors import optimizer_state_bytes_per_param
from ...engine.placement.placement import Location
from .recipe import TuneRecipe, load_recipe
from .settings import chosen_settings, searched_locations

# overrides the tuner decides; the user's values for them are dropped from the written file
_DECIDED = ("strategy", "strategy.name", "strategy.stage", "strategy.offload_optimizer", "strategy.offload_params",
            "data.batch_size")
_ENGINE_KEYS = ("stage", "offload_optimizer", "offload_params", "bucket_mb", "reduce_dtype", "broadcast_buffers",
                "unit_classes", "unit_mb", "persist_numel", "prefetch", "order_check", "activation_checkpointing",
                "offload_activations", "grad_reduce", "overlap_publish", "quantize_weights", "quantize_grads",
                "shard_group_size")


@dataclass
class Candidate:
    setting: str
    stage: int
    offload: bool
    est_states: float  # estimated device model states per rank (bytes)
    status: str = "pending"  # ranked | rejected | failed
    reason: str = ""
    max_batch: int = 0
    peak_bytes: Optional[int] = None
    seconds: Optional[float] = None
    steps: int = 0
    samples_per_s: Optional[float] = None
    probes: list = field(default_factory=list)


@dataclass
class TuneResult:
    candidates: list[Candidate]
    best: Optional[Candidate]
    overrides: list[str]  # the winning overrides (empty when nothing fits)
    out: Optional[str]
    budget_bytes: int
    world_size: int
    precision: str
    gpu: bool
    message: str = ""
    header: str = ""

    @property
    def ranked(self) -> list[Candidate]:
        return sorted((c for c in self.candidates if c.status == "ranked"), key=lambda c: -c.samples_per_s)

    def report(self) -> str:
        cap = "GPU cap (per-process memory fraction)" if self.gpu else "CPU byte budget (measured peak)"
        lines = [self.header,
                 f"memory cap {self.budget_bytes / MiB:.2f} MiB per rank, {cap}; {self.world_size} rank(s); "
                 f"precision {self.precision}", "",
                 "| rank | setting                    | micro-batch | samples/s | peak MiB/rank | est. states MiB/rank "
                 "| status |",
                 "|------|----------------------------|-------------|-----------|---------------|----------------------"
                 "|--------|"]
        ranked = self.ranked
        for i, c in enumerate(ranked, 1):
            lines.append(f"| {i:>4} | {c.setting:<26} | {c.max_batch:>11} | {c.samples_per_s:>9.1f} "
                         f"| {(c.peak_bytes or 0) / MiB:>13.2f} | {c.est_states / MiB:>20.2f} | fits   |")
        for c in self.candidates:
            if c.status != "ranked":
                lines.append(f"|    - | {c.setting:<26} | {'-':>11} | {'-':>9} | {'-':>13} "
                             f"| {c.est_states / MiB:>20.2f} | {c.status}: {c.reason} |")
        lines.append("")
        lines.append(self.message)
        return "\n".join(lines)


def _find_config_dir(config_dir: Optional[str]) -> Path:
    cands = [config_dir] if config_dir else [Path.cwd() / "conf", Path(__file__).resolve().parents[3] / "conf"]
    for c in cands:
        if c and (Path(c) / "t5_finetune.yaml").is_file():
            return Path(c).resolve()
    raise FileNotFoundError(f"No Hydra recipe config (t5_finetune.yaml) in {', '.join(map(str, cands))}; "
                            "pass --config-dir path/to/conf.")


def compose(config_dir: Path, config_name: str, overrides: Sequence[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return hydra_compose(config_name, overrides=list(overrides))


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


# activation variants of a setting the search tries (activations="search"): name suffix -> overrides
ACTIVATION_VARIANTS = {
    "": ["strategy.activation_checkpointing=null", "strategy.offload_activations=false"],
    "+ckpt": ["strategy.activation_checkpointing=auto", "strategy.offload_activations=false"],
    "+ckpt+offload": ["strategy.activation_checkpointing=auto", "strategy.offload_activations=true"],
}
_ACTIVATION_KEYS = ("strategy.activation_checkpointing", "strategy.offload_activations")


def winning_overrides(base: Sequence[str], setting: str, batch: int, searched: bool = False) -> list[str]:
    """``setting``: a preset, with an activation suffix of :data:`ACTIVATION_VARIANTS` when ``searched``."""
    preset, plus, rest = setting.partition("+")
    decided = _DECIDED + (_ACTIVATION_KEYS if searched else ())
    extra = ACTIVATION_VARIANTS[plus + rest] if searched else []
    return [o for o in base if _key(o) not in decided] + [f"strategy={preset}", *extra, f"data.batch_size={batch}"]


def _num_devices(devices, gpu: bool) -> int:
    if isinstance(devices, int):
        return devices
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        return int(devices)
    if isinstance(devices, (list, tuple)) or hasattr(devices, "__len__") and not isinstance(devices, str):
        return len(devices)
    import torch

    return torch.cuda.device_count() if gpu else (os.cpu_count() or 1)


def tune(
    overrides: Sequence[str] = (),
    memory_mb: Optional[float] = None,
    memory_gb: Optional[float] = None,
    out: Optional[str] = "tuned.overrides",
    config_dir: Optional[str] = None,
    config_name: str = "t5_finetune",
    stages: Sequence[int] | str = (0, 1, 2, 3),
    offload: str = "both",
    max_batch: int = 256,
    steps: int = 5,
    warmup: int = 1,
    bisect_tol: float = 0.0,
    start_method: Optional[str] = None,
    json_out: Optional[str] = None,
    prefilter: bool = True,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
    recipe: TuneRecipe | str | None = None,
    activations: str = "recipe",
) -> TuneResult:
    """Search stage x offload x micro-batch for the recipe experiment ``overrides`` under a memory cap per rank.

    ``memory_mb``/``memory_gb``: the cap per rank (MiB / GiB, 2**20 / 2**30 bytes): on a GPU the
    per-process memory fraction, on CPU the byte budget the measured peak is checked against.
    ``offload``: "both", "no" or "only". ``prefilter``: skip candidates whose estimated model states
    alone exceed the cap (False: measure them too). Returns a :class:`TuneResult`; writes the winner's
    overrides to ``out`` (one per line) when something fits. ``recipe``: what composes the experiment
    (:func:`.recipe.load_recipe`; default: the T5 recipe next to the config directory). ``activations``:
    "recipe" (the experiment's own activation options) or "search" (every setting also with
    ``activation_checkpointing=auto``, and with that plus ``offload_activations``: ``zero2+ckpt``, ...).
    """
    import torch
    from omegaconf import OmegaConf

    if (memory_mb is None) == (memory_gb is None):
        raise ValueError("Give exactly one memory cap: memory_mb or memory_gb.")
    budget = int(memory_mb * MiB if memory_mb is not None else memory_gb * GiB)
    chosen = chosen_settings(stages, offload)
    if activations not in ("recipe", "search"):
        raise ValueError(f"activations must be 'recipe' or 'search'; got {activations!r}.")
    searched = activations == "search"
    overrides = list(overrides)
    cdir = _find_config_dir(config_dir)
    recipe = load_recipe(recipe, cdir)
    cfg = compose(cdir, config_name, overrides)
    recipe.validate_schema(cfg)
    t5cfg = recipe.tune_model_config(cfg)
    dims = t5_dims_from_config(t5cfg)
    dims.name = cfg.model.preset
    info = info_from_t5(dims)
    precision = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}.get(str(cfg.trainer.precision),
                                                                           str(cfg.trainer.precision))
    if precision not in PRECISIONS:
        raise ValueError(f"trainer.precision={precision!r}: the tuner handles 32-true, bf16-mixed and 16-mixed.")
    mixed = PRECISIONS[precision]
    gpu = cfg.trainer.accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available()
    world = _num_devices(OmegaConf.to_container(cfg.trainer, resolve=True)["devices"], gpu)
    src, tgt = int(cfg.data.max_source_len), int(cfg.data.max_target_len)
    accum = int(cfg.trainer.accumulate_grad_batches)
    k = optimizer_state_bytes_per_param("adamw")
    header = (f"tune: T5 {dims.name} (Psi = {info.numel:,}), src {src} / tgt {tgt} tokens, AdamW, gradient "
              f"accumulation {accum}; overrides: {' '.join(overrides) or '(none)'}")
    if cfg.trainer.num_nodes != 1:
        log(f"note: trainer.num_nodes={cfg.trainer.num_nodes}; the tuner measures one node of {world} rank(s).")

    cands: list[Candidate] = []
    specs: dict[str, dict] = {}
    labels = {name: label for label, name in SETTINGS.items()}  # (stage, offload), as the result reports them
    for name in chosen:  # an NVMe preset's device memory is its CPU-offload twin's: nothing more to measure
        for suffix in (ACTIVATION_VARIANTS if searched else [""]):
            c = Candidate(name + suffix, *labels[name],
                          plan_state_bytes(info, SETTING_PLANS[name], world, mixed, k, accum > 1)["device"])
            cands.append(c)
            if prefilter and c.est_states > budget:
                c.status, c.reason = "rejected", f"model states alone need {c.est_states / MiB:.2f} MiB (estimate)"
                continue
            ccfg = compose(cdir, config_name, winning_overrides(overrides, c.setting, 1, searched))
            skw = recipe.strategy_kwargs(ccfg)
            specs[c.setting] = {k2: skw[k2] for k2 in _ENGINE_KEYS if k2 in skw}
    if specs:
        args = argparse.Namespace(
            specs=specs, t5_config=t5cfg.to_dict(), precision=precision, vocab=dims.vocab_size, src_len=src,
            tgt_len=tgt, lr=float(cfg.optim.lr), weight_decay=float(cfg.optim.weight_decay), seed=int(cfg.seed),
            budget_bytes=budget, cap_bytes=budget, max_batch=max_batch, start_batch=1, bisect_tol=bisect_tol,
            steps=steps, warmup=warmup, world_size=world, accumulate=accum, backend="nccl" if gpu else "gloo",
            threads=max(1, (os.cpu_count() or 1) // world))
        from .harness import launch

        method = start_method or ("spawn" if gpu else "fork")
        t0 = time.perf_counter()
        raw = launch(_body, args, world_size=world, start_method=method)
        log(f"measured {len(specs)} candidate(s) in {time.perf_counter() - t0:.0f} s")
        for c in cands:
            r = raw.get(c.setting)
            if r is None:
                continue
            c.probes = r.get("probes", [])
            if "error" in r:
                c.status, c.reason = "failed", r["error"]
            elif not r["max_batch"]:
                peak = r["probes"][0][2] if r["probes"] else 0
                c.status = "rejected"
                c.reason = ("out of memory at micro-batch 1" if gpu or not peak
                            else f"measured peak {peak / MiB:.2f} MiB at micro-batch 1")
            elif r.get("seconds") is None:
                c.status, c.reason = "failed", "timing failed (out of memory)"
            else:
                c.status, c.max_batch, c.peak_bytes = "ranked", r["max_batch"], r["peak_bytes"]
                c.seconds, c.steps = r["seconds"], r["steps"]
                c.samples_per_s = c.max_batch * accum * world * c.steps / c.seconds
    res = TuneResult(cands, None, [], None, budget, world, precision, gpu, header=header)
    ranked = res.ranked
    if ranked:
        best = res.best = ranked[0]
        res.overrides = winning_overrides(overrides, best.setting, best.max_batch, searched)
        recipe.validate_schema(compose(cdir, config_name, res.overrides))  # the recipe accepts it
        if out:
            Path(out).write_text("\n".join(res.overrides) + "\n")
            res.out = str(out)
        res.message = (f"best: {best.setting} at micro-batch {best.max_batch} ({best.samples_per_s:.1f} samples/s)"
                       + (f"; overrides written to {out}: python examples/t5_finetune.py $(cat {out})" if out else ""))
    else:
        res.message = nothing_fits_message(res, info, mixed, k, dims, src, tgt, searched_locations(offload), accum)
    if json_out:
        Path(json_out).write_text(json.dumps({"header": header, "budget_bytes": budget, "world_size": world,
                                              "candidates": [asdict(c) for c in cands],
                                              "overrides": res.overrides}, indent=1))
    return res


def nothing_fits_message(res: TuneResult, info, mixed: bool, k: int, dims, src: int, tgt: int,
                         searched: Sequence[Location], accum: int = 1) -> str:
    """Say that nothing fits and what would: more ranks (stage 3 shards everything), offload, a bigger cap.

    "What would" uses the estimator's peak (model states + stage-3 unit buffers + one sample's activations).
    """
    from ..estimate import min_ranks_to_fit

    budget, world = res.budget_bytes, res.world_size
    tried = ", ".join(c.setting for c in res.candidates) or "none"
    lines = [f"NOTHING FITS in {budget / MiB:.2f} MiB per rank on {world} rank(s) (tried: {tried})."]
    est = estimate_model_states(info, world, 1, res.precision, "adamw", grad_accumulation=accum, batch_size=1,
                                src_len=src, tgt_len=tgt, device_memory_gb=budget / GiB)
    would = []
    for name in ("zero3", "zero3_offload"):
        n = min_ranks_to_fit(est, name)
        if n is not None and n > world:
            would.append(f"more ranks: {name} on >= {n} ranks (estimated peak at micro-batch 1)")
    if not would:
        row = est.row("zero3_offload")
        fixed = row.buffers["backward"] + (row.activations or 0)
        would.append(f"more ranks alone do not help: stage 3's gathered units and one sample's activations "
                     f"need {fixed / MiB:.2f} MiB per rank whatever the rank count (estimate)")
    if Location.HOST not in searched:  # where the search kept optimizer states ([Note: placement])
        off = plan_state_bytes(info, SETTING_PLANS["zero3_offload"], world, mixed, k, accum > 1)["device"]
        would.append(f"offload: zero3_offload keeps only {off / MiB:.2f} MiB of model states per rank on "
                     f"{world} rank(s) (search with offload)")
    best = min(est.rows, key=lambda r: r.peak_device)
    would.append(f"a cap of >= {best.peak_device / MiB:.2f} MiB per rank ({best.setting} on {world} rank(s), "
                 "estimated peak at micro-batch 1)")
    if not mixed:
        would.append("bf16-mixed precision (trainer.precision=bf16-mixed) halves params, grads and activations")
    lines.append("What would fit:")
    lines += [f"  - {w}" for w in would]
    return "\n".join(lines)


# -- the ranks ------------------------------------------------------------------------------------------
def _body(rank: int, args) -> dict:
    """On every rank: search and time each candidate of ``args.specs``; rank 0's dict is the result."""
    import torch

    from .harness import Trial, search, timed

    gpu = args.backend == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    if gpu:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_bytes / total), device)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if rank == 0 else (lambda s: None)
    out = {}
    for name, spec in args.specs.items():
        trial = Trial(name, args, rank, device, build_fn=_builder(args, spec, device), batch_fn=_batch_fn(args))
        try:
            res = search(trial, args, log)
            b = res["max_batch"]
            res["seconds"], res["steps"] = None, 0
            if b:
                trial.ensure()
                for i in range(args.warmup):
                    trial.step(b, 5_000 + i)
                args.train_samples = args.steps * b * args.world_size
                res["seconds"], res["steps"] = timed(trial, args, b, args.world_size, train=True), args.steps
                log(f"  {name}: micro-batch {b}, {args.steps} steps in {res['seconds'] or float('nan'):.2f} s")
        except Exception as e:  # noqa: BLE001 -- one candidate's failure is a table row
            res = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]}
            log(f"  {name}: FAILED {res['error']}")
        trial.drop()
        out[name] = res
    return out


def _builder(args, spec: dict, device):
    def build():
        import torch
        from transformers import T5Config, T5ForConditionalGeneration

        from ...engine import ZeroConfig, ZeroEngine
        from .harness import Runner

        torch.manual_seed(args.seed)
        with device:
            model = T5ForConditionalGeneration(T5Config.from_dict(args.t5_config))
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        dtype = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}[args.precision]
        engine = ZeroEngine(model, opt, ZeroConfig(**spec), compute_dtype=dtype)
        return Runner("zero", model, model, opt, engine)

    return build


def _batch_fn(args):
    from .harness import t5_batch

    return lambda rank, step, b, device: t5_batch(args, rank, step, b, device)
