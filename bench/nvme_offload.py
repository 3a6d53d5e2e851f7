"""ZeRO-Infinity step time: ``zero3_offload_nvme`` vs ``zero3_offload`` (CPU) vs the disk's own bandwidth (issue 30).

One process (the states of one rank), a stack of ``--layers`` Linear(``--width``, ``--width``) layers (stage-3
units by class, one gradient bucket per layer), torch's fused CPU AdamW (the offloaded default), ``--threads``
intra-op threads. Three settings, each with ``--warmup`` untimed steps (the first creates the optimizer state)
then ``--steps`` timed ones, interleaved (cpu, nvme, cpu, nvme, ...):

* ``zero3_offload``: parameter shards and optimizer on the host (the baseline);
* ``opt_nvme``: optimizer (master + state) on NVMe, parameter shards on the host (``offload_params=True``);
* ``zero3_offload_nvme``: both on NVMe (``offload_params="nvme"``, what the preset does);
* ``zero3_offload_nvme_unverified``: the same with the scratch files' CRC32s off (``ScratchFile.CHECKSUMS``;
  no engine setting turns them off): what verifying every read costs a step.

Each step is timed in two parts: forward + backward, and ``engine.step()`` (the optimizer step with its
publish). The optimizer-only table compares ``engine.step()`` (forward and backward are the same for both);
the parameter table compares whole steps, because the parameter shards are read during forward and backward.

Bytes moved are counted, not derived: every ``ScratchFile.read`` / ``write`` the engine issues during the
timed steps is summed per file (parameters / optimizer).

The physical limit is measured the way the engine moves the bytes: ``os.pwritev`` then ``os.preadv`` of one
file of the states' size, in chunks of the optimizer ring slot's size (best of 3 passes), in the same directory
(``--path``, default /tmp). The disk's time for a step's I/O is ``read bytes / read GB/s + written bytes /
write GB/s``; the fraction of the disk a setting reaches is that time over its step time (the achieved GB/s
over the disk's GB/s for that read/write mix), and the overlap shows when the step is shorter than that I/O
time + the ``zero3_offload`` step's compute. The physical limit is taken phase by phase: forward + backward
(the shard reads against ``zero3_offload``'s forward + backward) and the step (the optimizer file's reads and
writes and the shard writes against its step), each the longer of compute and the disk's time -- I/O hides
behind the compute of its own phase, not of another -- so a step's fraction of the disk can reach at most
that limit's share, and "of the limit" says how close the engine comes.

The CRC32 is priced twice: the whole step with and without it (above), and ``zlib.crc32``'s own GB/s on one
core over one ring slot, beside the disk's GB/s (the disk test itself runs without checksums).

The disk figures go through the page cache, as the engine's I/O does (no O_DIRECT): on a host whose RAM
holds the scratch file they are memory-bound; ``--drop-cache`` adds ``os.fsync`` + ``POSIX_FADV_DONTNEED``
after the disk test's write, to show the device itself; ``--direct`` runs the engine with
``nvme_direct=True`` (the optimizer file; the parameter file always uses the page cache) and the disk test
with O_DIRECT too, plus a page-cache pass that the parameter file's bytes are held against.

Where DeepSpeed and its ``async_io`` op can run (``pip install -e ".[bench]"`` and libaio's headers:
``apt install libaio-dev``), DeepSpeed ZeRO-Infinity -- ``offload_optimizer`` and ``offload_param`` on nvme, its
default ``aio`` block, about one unit of prefetch -- trains the same model on the same inputs in a child process
after ours (its ``zero.Init`` patches ``F.linear`` process-wide), and a last table puts it beside
``zero3_offload_nvme``: phase times, the ratio, the host parameter buffers, the final loss. Its I/O is always
O_DIRECT, so ``--direct`` is the like-for-like comparison. ``--deepspeed off`` leaves it out.

Run::

    python bench/nvme_offload.py                      # ~1 minute on 2 loaded cores (25M params)
    python bench/nvme_offload.py --layers 8 --width 512 --steps 3
"""

from __future__ import annotations

import argparse
import json
import zlib
import os
import statistics
import sys
import shutil
import subprocess
import tempfile
import time
from collections import Counter

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ itself: deepspeed_peer
from lightning_zero.engine import ZeroConfig, ZeroEngine  # noqa: E402
from lightning_zero.engine.placement import nvme as NV  # noqa: E402
from lightning_zero.engine.placement.nvme import DIRECT_ALIGN, ScratchFile, aligned_empty  # noqa: E402
from lightning_zero.engine.placement.location import Location  # noqa: E402

SETTINGS = {"zero3_offload": (True, True), "opt_nvme": (True, "nvme"), "zero3_offload_nvme": ("nvme", "nvme"),
            "zero3_offload_nvme_unverified": ("nvme", "nvme")}
MOVED: Counter = Counter()  # (file kind, "read"/"write") -> bytes the engine's I/O asked for


def _kind(path: str) -> str:
    return "params" if "-params-" in path else ("optimizer" if "-optimizer-" in path else "other")


def _count_io() -> None:
    """Wrap ScratchFile.read / write (the only I/O of the engine's scratch files) with a byte counter."""
    real_read, real_write = ScratchFile.read, ScratchFile.write

    def read(self, buf, offset):
        MOVED[_kind(self.path), "read"] += buf.numel() * buf.element_size()
        return real_read(self, buf, offset)

    def write(self, buf, offset, *blocks):
        MOVED[_kind(self.path), "write"] += buf.numel() * buf.element_size()
        return real_write(self, buf, offset, *blocks)

    NV.ScratchFile.read, NV.ScratchFile.write = read, write


def build(layers: int, width: int, params, optimizer, path: str, direct: bool = False,
          buffers: int = 3, checksums: bool = True) -> tuple[nn.Module, ZeroEngine]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    bucket_mb = (width * width + width) * 4 / 2**20  # one layer per bucket: the ring's slot
    on_disk = "nvme" in (params, optimizer)
    cfg = ZeroConfig(stage=3, offload_optimizer=optimizer, offload_params=params, unit_classes=["Linear"],
                     persist_numel=0, bucket_mb=bucket_mb, nvme_path=path if on_disk else None,
                     nvme_direct=direct and optimizer == "nvme", nvme_buffer_count=buffers if on_disk else 3)
    ScratchFile.CHECKSUMS = checksums  # read when a file is made: this engine's files only
    try:
        return model, ZeroEngine(model, opt, cfg)
    finally:
        ScratchFile.CHECKSUMS = True


def shard_host_bytes(engine: ZeroEngine) -> int:
    """Host bytes held for parameter shards now: the shards' own storages (0 while on disk) + the ring."""
    part = engine.partitioner
    ring = sum(s.buf.numel() for s in part.store.ring) if part.store.checks_io else 0
    return sum(u.shard.untyped_storage().nbytes() for u in part.units if u.shard is not None) + ring


def step_input(width: int, step: int, batch: int) -> torch.Tensor:
    return torch.randn(batch, width, generator=torch.Generator().manual_seed(step))


def one_step(model: nn.Module, engine: ZeroEngine, width: int, step: int,
             batch: int = 8) -> tuple[float, float, float]:
    """(forward + backward seconds, engine.step() seconds, the loss)."""
    t0 = time.perf_counter()
    engine.prepare_forward()
    loss = model(step_input(width, step, batch)).pow(2).mean()
    loss.backward()
    t1 = time.perf_counter()
    engine.step()
    return t1 - t0, time.perf_counter() - t1, loss.item()


def disk_bandwidth(path: str, nbytes: int, chunk: int, drop_cache: bool, direct: bool = False) -> dict:
    """Sequential write then read of ``nbytes`` in ``chunk``-byte pieces, as the ring does, in the engine's
    steady state: the file reserved and written once untimed (the engine's file is written at setup and on
    every step), then one timed write pass and one timed read pass over it."""
    f = ScratchFile(path, 0, tag="bench", direct=direct, checksums=False)  # the disk alone
    buf = aligned_empty(chunk, align=DIRECT_ALIGN if direct else 1)
    buf.random_(0, 255)
    n = max(1, nbytes // chunk)
    try:
        f.reserve(n * chunk)
        for i in range(n):
            f.write(buf, i * chunk)
        t0 = time.perf_counter()
        for i in range(n):
            f.write(buf, i * chunk)
        if drop_cache:
            os.fsync(f.fd)
            os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t1 = time.perf_counter()
        for i in range(n):
            f.read(buf, i * chunk)
        t2 = time.perf_counter()
    finally:
        f.close()
    moved = n * chunk
    return {"write_s": t1 - t0, "read_s": t2 - t1, "bytes": moved,
            "write_gbs": moved / (t1 - t0) / 1e9, "read_gbs": moved / (t2 - t1) / 1e9,
            "rw_gbs": 2 * moved / (t2 - t0) / 1e9}


def crc_gbs(nbytes: int) -> float:
    """zlib.crc32's GB/s on one core over a buffer of ``nbytes`` (one ring slot), best of 5."""
    data = os.urandom(max(nbytes, 1))
    best = min(_timed(lambda: zlib.crc32(data)) for _ in range(5))
    return len(data) / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def io_row(parts: list, step_s: float, cpu_s: float) -> dict:
    """A setting's bytes against the disk: the disk's own time for them, the fraction reached, the overlap.
    ``parts``: (read bytes, written bytes, the disk figures of the file's I/O mode) per scratch file."""
    io_s = sum(r / d["read_gbs"] / 1e9 + w / d["write_gbs"] / 1e9 for r, w, d in parts)
    reads, writes = sum(p[0] for p in parts), sum(p[1] for p in parts)
    moved = reads + writes
    return {"read_bytes": reads, "write_bytes": writes, "bytes": moved, "step_s": step_s,
            "achieved_gbs": moved / step_s / 1e9, "disk_gbs": moved / io_s / 1e9 if io_s else 0.0,
            "fraction_of_disk": io_s / step_s, "io_s": io_s, "serial_s": io_s + cpu_s,
            "ratio": step_s / cpu_s, "overlap_visible": step_s < io_s + cpu_s}


def phase_bound(phases: list[tuple[float, float]]) -> float:
    """The shortest step the hardware allows: within a phase, I/O can hide behind compute (or the reverse), never
    across phases (the step's reads cannot start before backward has reduced the gradients they meet).
    ``phases``: (compute s, the disk's own I/O s) per phase."""
    return sum(max(cpu, io) for cpu, io in phases)


def deepspeed_worker(args) -> None:
    """DeepSpeed ZeRO-Infinity on the same model, inputs and steps, in its own process (its ``zero.Init``
    patches ``torch.nn.functional.linear`` for the whole process, which must not touch our runs)."""
    import deepspeed_peer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.ds_port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    path = tempfile.mkdtemp(prefix="ds-infinity-", dir=args.path)
    torch.manual_seed(0)
    engine, config = deepspeed_peer.build_infinity(
        lambda: nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)]), path,
        args.batch, args.width * args.width, lr=1e-4)
    fb, st, loss = [], [], None
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        out = engine(step_input(args.width, step, args.batch)).pow(2).mean()
        engine.backward(out)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        loss = out.item()
        if step >= args.warmup:
            fb.append(t1 - t0)
            st.append(t2 - t1)
    zero = config["zero_optimization"]
    with open(args.ds_worker, "w") as fh:
        json.dump({"fwd_bwd": statistics.median(fb), "step": statistics.median(st),
                   "whole": statistics.median(a + b for a, b in zip(fb, st)), "final_loss": loss,
                   "param_buffers_bytes": 4 * zero["offload_param"]["buffer_count"] * zero["offload_param"]["buffer_size"],
                   "config": config}, fh)
    shutil.rmtree(path, ignore_errors=True)


def deepspeed_row(args) -> dict:
    """Run :func:`deepspeed_worker` in a child process: its medians, or ``{"missing": why}``."""
    import deepspeed_peer

    why = deepspeed_peer.infinity_missing()
    if why is not None:
        return {"missing": why}
    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        cmd = [sys.executable, os.path.abspath(__file__), "--ds-worker", fh.name, "--layers", str(args.layers),
               "--width", str(args.width), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--threads", str(args.threads), "--batch", str(args.batch), "--path", args.path]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            return {"missing": "DeepSpeed ZeRO-Infinity failed: " + done.stderr.strip().splitlines()[-1]}
        return json.load(open(fh.name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8, help="rows per step: fewer make the step I/O-bound")
    ap.add_argument("--buffers", type=int, default=3, help="nvme_buffer_count (the ring's host buffers)")
    ap.add_argument("--path", default=tempfile.gettempdir())
    ap.add_argument("--drop-cache", action="store_true")
    ap.add_argument("--direct", action="store_true", help="nvme_direct=True, and O_DIRECT for the disk test too")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    ap.add_argument("--deepspeed", choices=("auto", "off"), default="auto",
                    help="auto: DeepSpeed ZeRO-Infinity as a peer where it can run (it says why where not)")
    ap.add_argument("--ds-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ds-port", type=int, default=29531, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.ds_worker:
        return deepspeed_worker(args)
    _count_io()

    runs = {name: build(args.layers, args.width, p, o, args.path, args.direct, args.buffers,
                        checksums=not name.endswith("_unverified")) for name, (p, o) in SETTINGS.items()}
    fb = {name: [] for name in runs}
    st = {name: [] for name in runs}
    moved = {name: Counter() for name in runs}
    held = {name: [] for name in runs}
    losses: dict[str, float] = {}
    for name, (model, engine) in runs.items():  # host bytes for parameter shards, in forward and backward
        def probe(*_, e=engine, n=name):
            held[n].append(shard_host_bytes(e))

        for layer in model:  # after the engine's hooks: with the unit gathered
            layer.register_forward_pre_hook(probe)
        pre_backward = engine.partitioner._pre_backward
        engine.partitioner._pre_backward = lambda u, pb=pre_backward, pr=probe: (pb(u), pr())
    for step in range(args.warmup + args.steps):
        for name, (model, engine) in runs.items():
            before = MOVED.copy()
            t_fb, t_st, losses[name] = one_step(model, engine, args.width, step, args.batch)
            if step >= args.warmup:
                fb[name].append(t_fb)
                st[name].append(t_st)
                moved[name] += MOVED - before
                held[name].append(shard_host_bytes(engine))  # between steps
    med = {n: {"fwd_bwd": statistics.median(fb[n]), "step": statistics.median(st[n]),
               "whole": statistics.median(a + b for a, b in zip(fb[n], st[n]))} for n in runs}
    per = {n: {k: v / args.steps for k, v in moved[n].items()} for n in runs}
    reps = {n: e.memory_report() for n, (_, e) in runs.items()}
    part = runs["zero3_offload_nvme"][1].partitioner
    params_on_disk = part.store.bytes_by_location().get(Location.NVME, 0)
    opt_on_disk = reps["opt_nvme"].nvme
    slot = max(e.sharded.states.slot_bytes for n, (_, e) in runs.items() if n != "zero3_offload")

    def best_of_3(direct: bool) -> dict:  # the VM's disk is noisy
        return min((disk_bandwidth(args.path, opt_on_disk + params_on_disk, slot, args.drop_cache, direct)
                    for _ in range(3)), key=lambda d: d["read_s"] + d["write_s"])

    disk = best_of_3(args.direct)
    crc = crc_gbs(slot)
    # the parameter file always goes through the page cache: its bytes against that mode's figures
    disk_params = best_of_3(False) if args.direct else disk
    ring = part.store.ring_bytes
    for _, engine in runs.values():
        engine.remove(hand_back=False)

    peer = deepspeed_row(args) if args.deepspeed == "auto" else {"missing": "--deepspeed off"}

    def rw(n, kind):
        return per[n].get((kind, "read"), 0.0), per[n].get((kind, "write"), 0.0)

    opt_r, opt_w = rw("opt_nvme", "optimizer")
    old = io_row([(opt_r, opt_w, disk)], med["opt_nvme"]["step"], med["zero3_offload"]["step"])
    (pr, pw), (orr, ow) = rw("zero3_offload_nvme", "params"), rw("zero3_offload_nvme", "optimizer")
    new = io_row([(pr, pw, disk_params), (orr, ow, disk)], med["zero3_offload_nvme"]["whole"],
                 med["zero3_offload"]["whole"])
    # the physical limit, phase by phase: forward + backward read the parameter shards; the step reads and
    # writes the optimizer file and writes the shards (compute: zero3_offload's own phases)
    cpu = med["zero3_offload"]
    fb_io = pr / disk_params["read_gbs"] / 1e9
    st_io = new["io_s"] - fb_io
    bound = phase_bound([(cpu["fwd_bwd"], fb_io), (cpu["step"], st_io)])
    new.update(bound_s=bound, best_fraction=new["io_s"] / bound, of_bound=bound / new["step_s"])
    old_bound = phase_bound([(cpu["step"], old["io_s"])])
    old.update(bound_s=old_bound, best_fraction=old["io_s"] / old_bound, of_bound=old_bound / old["step_s"])
    out = {
        "params": sum(p.numel() for p in runs["zero3_offload"][0].parameters()), "medians": med, "per_step": {
            n: {f"{k}_{op}": v for (k, op), v in d.items()} for n, d in per.items()},
        "opt_on_disk_bytes": opt_on_disk, "params_on_disk_bytes": params_on_disk,
        "params_ring_bytes": ring, "params_held_max": max(held["zero3_offload_nvme"]),
        "params_held_cpu_max": max(held["zero3_offload"]), "optimizer_only": old, "params_and_optimizer": new,
        "disk": disk, "disk_params_file": disk_params, "threads": args.threads, "path": args.path, "drop_cache": args.drop_cache,
        "direct": args.direct, "load_average": os.getloadavg(), "final_losses": losses, "deepspeed": peer,
        "crc32_gbs": crc,
    }
    mib = 2**20
    print(f"{out['params']:,} params; disk {args.path}: write {disk['write_gbs']:.2f} GB/s, read "
          f"{disk['read_gbs']:.2f} GB/s, read+write {disk['rw_gbs']:.2f} GB/s"
          + (f" (O_DIRECT; page cache, the parameter file's: write {disk_params['write_gbs']:.2f}, read "
             f"{disk_params['read_gbs']:.2f} GB/s)" if args.direct else "") + "; load average "
          + " ".join(f"{x:.2f}" for x in out["load_average"]))
    print(f"optimizer on NVMe, parameter shards on the host: on disk {opt_on_disk / mib:.1f} MiB, ring "
          f"{reps['opt_nvme'].ring / mib:.2f} MiB; engine.step() timed")
    print("| setting | step (s) | bytes moved / step | achieved GB/s | of disk | step ratio | overlap |")
    print("|---|---|---|---|---|---|---|")
    print(f"| zero3_offload | {med['zero3_offload']['step']:.3f} | 0 | - | - | 1.00 | - |")
    print(f"| optimizer nvme, params cpu | {old['step_s']:.3f} | {old['bytes'] / mib:.1f} MiB | "
          f"{old['achieved_gbs']:.2f} | {100 * old['fraction_of_disk']:.0f}% | {old['ratio']:.2f} | "
          f"{old['io_s']:.3f} + {med['zero3_offload']['step']:.3f} = {old['serial_s']:.3f}: "
          f"{'visible' if old['overlap_visible'] else 'not visible'} |")
    print(f"zero3_offload_nvme (parameter shards and optimizer on NVMe): on disk {params_on_disk / mib:.1f} MiB "
          f"params + {reps['zero3_offload_nvme'].nvme / mib - params_on_disk / mib:.1f} MiB optimizer; "
          f"whole step (forward + backward + step) timed")
    print("| setting | fwd+bwd (s) | step() (s) | whole (s) | params read / written per step | optimizer read / "
          "written per step | achieved GB/s | disk GB/s (this mix) | of disk | step ratio | I/O + CPU step, serial"
          " (s) | overlap |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    m = med["zero3_offload"]
    print(f"| zero3_offload | {m['fwd_bwd']:.3f} | {m['step']:.3f} | {m['whole']:.3f} | 0 | 0 | - | - | - | 1.00 "
          f"| - | - |")
    m = med["zero3_offload_nvme"]
    print(f"| zero3_offload_nvme | {m['fwd_bwd']:.3f} | {m['step']:.3f} | {m['whole']:.3f} | {pr / mib:.1f} / "
          f"{pw / mib:.1f} MiB | {orr / mib:.1f} / {ow / mib:.1f} MiB | {new['achieved_gbs']:.2f} | "
          f"{new['disk_gbs']:.2f} | {100 * new['fraction_of_disk']:.0f}% | {new['ratio']:.2f} | {new['io_s']:.3f} + "
          f"{med['zero3_offload']['whole']:.3f} = {new['serial_s']:.3f} | "
          f"{'visible' if new['overlap_visible'] else 'not visible'} |")
    for label, row in (("optimizer nvme, params cpu (engine.step())", old), ("zero3_offload_nvme (whole step)", new)):
        print(f"physical limit, {label}: {row['bound_s']:.3f} s (phase by phase, the longer of compute and the "
              f"disk's time), at most {100 * row['best_fraction']:.0f}% of the disk; the step reaches "
              f"{100 * row['of_bound']:.0f}% of that limit")
    print(f"parameter reads per step = {pr / max(params_on_disk, 1):.2f} x the shards on disk, writes "
          f"{pw / max(params_on_disk, 1):.2f} x; host bytes for parameter shards (max seen in forward, backward, "
          f"between steps): {out['params_held_max'] / mib:.2f} MiB (ring {ring / mib:.2f} MiB) "
          f"vs {params_on_disk / mib:.1f} MiB on disk ({params_on_disk / max(ring, 1):.1f}x); "
          f"zero3_offload holds {out['params_held_cpu_max'] / mib:.1f} MiB of shards")
    v, u = med["zero3_offload_nvme"]["whole"], med["zero3_offload_nvme_unverified"]["whole"]
    print(f"CRC32 of every scratch read and write: zlib.crc32 {crc:.2f} GB/s on one core (beside the disk's read "
          f"{disk['read_gbs']:.2f} / write {disk['write_gbs']:.2f} GB/s); zero3_offload_nvme whole step {v:.3f} s "
          f"verified vs {u:.3f} s unverified ({100 * (v / u - 1):+.1f}%); final losses equal: "
          f"{losses['zero3_offload_nvme'] == losses['zero3_offload_nvme_unverified']}")
    if "missing" in peer:
        print(f"DeepSpeed ZeRO-Infinity: not run ({peer['missing']})")
    else:
        m, ds = med["zero3_offload_nvme"], peer
        print("DeepSpeed ZeRO-Infinity (offload_optimizer + offload_param on nvme, async_io; its own process, "
              "after ours, not interleaved):")
        print("| setting | fwd+bwd (s) | step() (s) | whole (s) | vs zero3_offload_nvme | host parameter buffers "
              "| final loss |")
        print("|---|---|---|---|---|---|---|")
        print(f"| zero3_offload_nvme | {m['fwd_bwd']:.3f} | {m['step']:.3f} | {m['whole']:.3f} | 1.00 | "
              f"{ring / mib:.2f} MiB | {losses['zero3_offload_nvme']:.6g} |")
        print(f"| ds_zero3_offload_nvme | {ds['fwd_bwd']:.3f} | {ds['step']:.3f} | {ds['whole']:.3f} | "
              f"{ds['whole'] / m['whole']:.2f} | {ds['param_buffers_bytes'] / mib:.2f} MiB | {ds['final_loss']:.6g} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
