"""How long training stands still per checkpoint save (issue 46): synchronous vs asynchronous saves at ZeRO
stages 1, 2, 3 and zero3_offload, through Lightning's Trainer as a user runs it, and what a run that saves every
N steps costs end to end.

What it measures
----------------
HF T5 built from its config (``--model``, default T5-small: 60.5M parameters, so fp32 parameters + Adam's two
moments are ~730 MB of state in all, ~365 MB per rank; random init, nothing downloaded), AdamW, synthetic
batches, 2 gloo ranks of one thread each (``--device cuda``: NCCL, one rank per GPU, at most 2). Every run is
``Trainer(strategy=ZeroStrategy(**PRESETS[method], async_save=...)).fit(...)`` for ``--steps`` steps in fresh
processes (so one run's kept heap never counts in another's peak RSS), with a callback that, after every
``--every``-th step, calls ``trainer.save_checkpoint(dir)`` -- exactly what ``ModelCheckpoint`` does -- and times
the call. Modes per method: ``none`` (the same run, no save: the baseline), ``sync`` (the default: the call
returns once the directory is complete), ``async`` (``async_save=True``: the call returns once the state is
staged in host memory, after waiting for the previous save; the write runs in a background thread).

Reported per method and mode (medians over every save / step of every round; a step's and a save's time is
the slower rank's):

* **stall**: wall time of ``trainer.save_checkpoint`` on the training thread, median and max;
* **step**: a training step's wall time (``on_train_batch_start`` -> ``on_train_batch_end``) away from saves, and
  of the step right after a save (``none``: the steps at the same positions): an async write shares the
  machine's cores with training, so part of what the save no longer stalls comes back here;
* **loop**: ``on_train_start`` -> ``fit`` returned (teardown waits for an async write still in flight), and the
  overhead per save: (loop - the same round's ``none`` loop) / saves;
* **ckpt**: bytes of one checkpoint directory; **peak RSS**: rank 0's ``VmHWM`` (/proc/self/status) at the end
  of the run -- an async save stages a host copy of the rank's state, memory a ZeRO user pays.

Repetitions are interleaved: each round runs every (method, mode) once, the order rotated per round; overheads
pair a run with its own round's baseline, so the machine's load swings cancel. The issue's target: async
stall <= 25% of sync.

Run::

    python bench/checkpoint_stall.py                      # T5-small, 3 rounds, ~15 minutes on 2 cores at load 3-6
    python bench/checkpoint_stall.py --model t5_tiny --steps 4 --every 2 --rounds 1 --methods zero1,zero3
    python bench/checkpoint_stall.py --device cuda        # pinned staging; bench/gpu_check.sh part 9
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import launch, print_and_dump  # noqa: E402
from seed_table import make_t5, t5_config  # noqa: E402
from lightning_zero.tools.tuning.harness import t5_batch  # noqa: E402

METHODS = ("zero1", "zero2", "zero3", "zero3_offload")
MODES = ("none", "sync", "async")
TARGET = 0.25  # the issue's: async stall <= 25% of sync
SKIP_STEPS = 1  # the first step creates the optimizer state: never a "step away from saves"


def strategy_kwargs(method: str, mode: str) -> dict:
    """``ZeroStrategy``'s arguments for one row: the preset's knobs, and ``async_save=True`` for async (sync and
    none keep the default, so the bench also runs on code without the knob)."""
    from lightning_zero.engine.config import PRESETS

    return {**PRESETS[method], **({"async_save": True} if mode == "async" else {})}


def peak_rss_bytes() -> int:
    """This process's peak resident set (``VmHWM``), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def run_body(rank: int, args) -> dict:
    """One fit on this rank; the slower rank's step and save times, rank 0's directory bytes and peak RSS."""
    from lightning.pytorch import Callback, LightningModule, Trainer
    from torch.utils.data import DataLoader

    from lightning_zero import ZeroStrategy

    cuda = args.device == "cuda"
    # a CUDA step ends when its kernels do; device work a save leaves queued (its staging copies) is counted in its
    # stall, the conservative side: the next step's kernels would queue behind it
    device_sync = torch.cuda.synchronize if cuda else (lambda: None)

    class T5Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(args.seed)
            self.t5 = make_t5(args)

        def training_step(self, batch, batch_idx):
            return self.t5(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=args.lr)

    class SaveTimer(Callback):
        """Times every step and every ``trainer.save_checkpoint`` call the way a user's loop meets them."""

        def __init__(self) -> None:
            self.steps: list[float] = []
            self.stalls: list[float] = []
            self.after_save: list[int] = []  # indices (into steps) of the steps right after a save
            self.records: list = []  # async: the saver's record of each save (kept: teardown clears its list)
            self.t_train = self.t_step = 0.0

        def on_train_start(self, trainer, pl_module) -> None:
            self.t_train = time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            device_sync()
            self.t_step = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            device_sync()
            self.steps.append(time.perf_counter() - self.t_step)
            if args.mode != "none" and trainer.global_step % args.every == 0:
                t0 = time.perf_counter()
                trainer.save_checkpoint(os.path.join(args.ckpt_dir, f"step{trainer.global_step}"))
                device_sync()
                self.stalls.append(time.perf_counter() - t0)
                saver = getattr(getattr(trainer.strategy, "checkpoints", None), "saver", None)
                if saver is not None and saver.records:
                    self.records.append(saver.records[-1])
            if trainer.global_step % args.every == 0:  # none: the same positions, the control
                self.after_save.append(len(self.steps))

    world = dist.get_world_size()
    data = [{k: v[0] for k, v in t5_batch(args, 0, i, 1, "cpu").items()}
            for i in range(args.steps * args.batch * world)]
    timer = SaveTimer()
    trainer = Trainer(strategy=ZeroStrategy(**strategy_kwargs(args.method, args.mode)),
                      accelerator="gpu" if cuda else "cpu", devices=world, max_steps=args.steps, callbacks=[timer],
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(T5Module(), DataLoader(data, batch_size=args.batch))
    loop_s = time.perf_counter() - timer.t_train  # teardown joined an async write still in flight
    if len(timer.steps) != args.steps:
        raise RuntimeError(f"{len(timer.steps)} steps timed, {args.steps} asked")
    if args.mode == "async" and len(timer.records) != len(timer.stalls):
        raise RuntimeError(f"{len(timer.stalls)} async saves, {len(timer.records)} recorded by the strategy's saver")
    if any(r.written_s is None for r in timer.records):
        raise RuntimeError("fit returned with an async write not finished")
    # async: of each stall, the wait for the previous save; and each write's time in the background
    saver_times = [r.waited_s for r in timer.records] + [r.written_s for r in timer.records]
    times = torch.tensor(timer.steps + timer.stalls + saver_times + [loop_s], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step or a save stands still until the slower rank is done
    times = times.tolist()
    n, k = args.steps, len(timer.stalls)
    out = {"steps_s": times[:n], "stalls_s": times[n:n + k], "loop_s": times[-1],
           "waited_s": times[n + k:n + k + len(timer.records)], "written_s": times[n + k + len(timer.records):-1],
           "after_save": [i for i in timer.after_save if i < args.steps], "peak_rss": peak_rss_bytes()}
    saved = sorted(os.listdir(args.ckpt_dir)) if rank == 0 else []
    if rank == 0 and args.mode != "none":
        out["saves"] = saved
        out["ckpt_bytes"] = dir_bytes(os.path.join(args.ckpt_dir, f"step{args.every}"))
    return out


def run_once(method: str, mode: str, args) -> dict:
    """One fit of ``method`` in ``mode`` on fresh ranks; its checkpoints removed afterwards."""
    run_args = argparse.Namespace(**vars(args), method=method, mode=mode,
                                  ckpt_dir=tempfile.mkdtemp(prefix=f"stall-{method}-{mode}-", dir=args.ckpt_root))
    try:
        t0 = time.perf_counter()
        out = launch(run_body, run_args, world_size=args.world_size,
                     start_method="spawn" if args.device == "cuda" else "fork")
        out["process_s"] = time.perf_counter() - t0
        return out
    except Exception as e:  # noqa: BLE001 -- one run's failure is its row's
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e) else ''}"[:300]}
    finally:
        shutil.rmtree(run_args.ckpt_dir, ignore_errors=True)


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def plain_steps(run: dict) -> list[float]:
    """A run's step times away from saves (and past the first step, which creates the optimizer state)."""
    marks = set(run["after_save"])
    return [t for i, t in enumerate(run["steps_s"]) if i >= SKIP_STEPS and i not in marks]


def summarize(runs: dict, args) -> dict:
    """Per method and mode: medians over all rounds (stalls and steps pooled; overheads paired per round)."""
    out: dict[str, dict] = {}
    n_saves = args.steps // args.every
    for m in args.methods:
        out[m] = {}
        for mode in args.modes:
            reps = runs[m][mode]
            ok = [r for r in reps if "error" not in r]
            if not ok:
                out[m][mode] = {"error": next((r["error"] for r in reps), "not run")}
                continue
            plain, after = [], []
            for r in ok:
                plain += plain_steps(r)
                after += [r["steps_s"][i] for i in r["after_save"]]
            pairs = [(r, b) for r, b in zip(reps, runs[m].get("none", []))
                     if mode != "none" and "error" not in r and "error" not in b]
            overheads = [(r["loop_s"] - b["loop_s"]) / n_saves for r, b in pairs]
            stalls = [s for r in ok for s in r["stalls_s"]]
            out[m][mode] = {
                "stall_s": med(stalls), "stall_max_s": max(stalls) if stalls else float("nan"),
                "step_s": med(plain), "step_after_save_s": med(after), "loop_s": med([r["loop_s"] for r in ok]),
                "overhead_per_save_s": med(overheads), "waited_s": med([w for r in ok for w in r["waited_s"]]),
                "written_s": med([w for r in ok for w in r["written_s"]]), "ckpt_bytes": ok[-1].get("ckpt_bytes", 0),
                "peak_rss": int(med([r["peak_rss"] for r in ok])), "rounds": len(ok), "saves": len(stalls),
            }
        s, a = out[m].get("sync", {}), out[m].get("async", {})
        if "stall_s" in s and "stall_s" in a:
            out[m]["async_over_sync"] = a["stall_s"] / s["stall_s"]
    return out


def fmt_row(m: str, mode: str, r: dict) -> str:
    if "error" in r:
        return f"| {m} | {mode} | FAILED: {r['error']} |"
    ms = lambda s: f"{s * 1e3:.0f}"  # noqa: E731
    mib = lambda b: f"{b / 2**20:.0f}" if b else "-"  # noqa: E731
    if mode == "none":
        return (f"| {m} | {mode} | - | - | - | - | {ms(r['step_s'])} | {ms(r['step_after_save_s'])} "
                f"| {r['loop_s']:.1f} | - | - | {mib(r['peak_rss'])} |")
    bg = lambda key, f: f(r[key]) if mode == "async" else "-"  # noqa: E731 -- the saver's records: async only
    return (f"| {m} | {mode} | {ms(r['stall_s'])} | {ms(r['stall_max_s'])} | {bg('waited_s', ms)} "
            f"| {bg('written_s', lambda x: f'{x:.1f}')} | {ms(r['step_s'])} | {ms(r['step_after_save_s'])} "
            f"| {r['loop_s']:.1f} | {r['overhead_per_save_s']:.2f} | {mib(r['ckpt_bytes'])} | {mib(r['peak_rss'])} |")


def print_table(s: dict, args) -> list[str]:
    n_saves = args.steps // args.every
    lines = [
        f"model: T5 {args.model} from its config; AdamW; {args.world_size} ranks "
        f"{'NCCL' if args.device == 'cuda' else 'gloo, 1 thread each'}; batch {args.batch}/rank, src {args.src_len} "
        f"/ tgt {args.tgt_len}; Trainer.fit of {args.steps} steps, trainer.save_checkpoint every "
        f"{args.every} steps ({n_saves} saves); {args.rounds} interleaved rounds, each run in fresh processes",
        "stall = trainer.save_checkpoint wall time on the training thread (async: of which waited for the previous "
        "save; write = the background write's time, from the strategy's saver records); step = a step away from "
        "saves | the step right after a save (none: same positions); loop = on_train_start -> fit returned; "
        "overhead = (loop - the round's none loop) / saves; ckpt = one checkpoint directory; peak RSS = rank 0's VmHWM",
        "",
        "| method | saves | stall ms median | stall ms max | of which waited ms | write s (background) | step ms "
        "| step after save ms | loop s | overhead s/save | ckpt MiB | peak RSS rank 0 MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in args.methods:
        lines += [fmt_row(m, mode, s[m][mode]) for mode in args.modes]
    for m in args.methods:
        if "async_over_sync" in s[m]:
            ratio = s[m]["async_over_sync"]
            lines.append(f"{m}: async stall / sync stall = {ratio:.3f} (target <= {TARGET}: "
                         f"{'met' if ratio <= TARGET else 'NOT met'})")
    return lines


def check_modes(args) -> None:
    """One clear error before any rank starts: every strategy of the table must construct on this code."""
    from lightning_zero import ZeroStrategy

    for mode in args.modes:
        try:
            ZeroStrategy(**strategy_kwargs(args.methods[0], mode))
        except (TypeError, ValueError) as e:
            raise ValueError(f"--modes {mode}: ZeroStrategy({strategy_kwargs(args.methods[0], mode)}) is refused by "
                             f"this code ({e}); allowed modes here: none, sync") from None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="t5_small", help="preset of lightning_zero/tools/t5_dims.T5_PRESETS")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list from {','.join(METHODS)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list from {','.join(MODES)}")
    p.add_argument("--steps", type=int, default=12, help="training steps per run")
    p.add_argument("--every", type=int, default=4, help="save after every N-th step")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (every method x mode once each)")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--src-len", type=int, default=32)
    p.add_argument("--tgt-len", type=int, default=16)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ckpt-root", default=None, help="where the runs' checkpoint directories go (default: a temp dir)")
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for what, given, allowed in (("methods", args.methods, METHODS), ("modes", args.modes, MODES)):
        bad = [x for x in given if x not in allowed]
        if bad or not given:
            p.error(f"--{what} {','.join(given)!r}: unknown {bad or 'none given'}; allowed: {', '.join(allowed)}")
    if args.every < 1 or args.steps < max(2, args.every) or args.rounds < 1:
        p.error("--every >= 1, --steps >= max(2, --every) and --rounds >= 1 (each run saves at least once)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible; allowed here: --device cpu")
    try:
        check_modes(args)
    except ValueError as e:
        p.error(str(e))
    args.world_size = min(2, torch.cuda.device_count()) if args.device == "cuda" else 2
    args.backend, args.threads = ("nccl", 4) if args.device == "cuda" else ("gloo", 1)
    args.lr, args.seed = 1e-4, 0
    args.vocab = t5_config(args).vocab_size
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    combos = [(m, mode) for m in args.methods for mode in args.modes]
    runs: dict[str, dict] = {m: {mode: [] for mode in args.modes} for m in args.methods}
    for rnd in range(args.rounds):
        k = rnd % len(combos)
        for m, mode in combos[k:] + combos[:k]:  # rotated: no run always first or after the same one
            runs[m][mode].append(run_once(m, mode, args))
            print(f"  round {rnd + 1}/{args.rounds}: {m} {mode} done ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr, flush=True)
    s = summarize(runs, args)
    print_and_dump(print_table(s, args), t0, args, {"summary": s, "runs": runs})


if __name__ == "__main__":
    main()
