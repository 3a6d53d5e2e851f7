"""Plot model-state bytes per rank by ZeRO stage (measured) against the model-state floor -> docs/memory_by_stage.png.

Measures with the shared harness (``bench/harness.py``: the bench TinyLM, fp32, AdamW, 2 gloo ranks; bytes
after a backward, before the step, as in step_time.py / peers.py), one short round -- memory does not
depend on timing -- or reads a ``--json`` written by ``bench/peers.py`` / ``bench/step_time.py``.
Needs matplotlib (a bench-only tool: ``pip install matplotlib``; not a dependency of the package).

Run::

    python bench/plot_memory.py                       # ~20 s; writes docs/memory_by_stage.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import WORLD_SIZE, launch, make_batches, method_floor, run_rounds  # noqa: E402

METHODS = ("zero0", "zero1", "zero2", "zero3", "zero1_offload", "zero2_offload", "zero3_offload")
LABELS = {"zero0": "stage 0\n(DDP-eq.)", "zero1": "stage 1", "zero2": "stage 2", "zero3": "stage 3",
          "zero1_offload": "stage 1\noffload", "zero2_offload": "stage 2\noffload", "zero3_offload": "stage 3\noffload"}


def body(rank: int, args) -> dict:
    batches = make_batches(args.warmup + args.steps, rank, args.batch, args.seq, args.vocab)
    return {"methods": run_rounds(list(METHODS), args, batches, rank)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="reuse a peers.py / step_time.py --json output instead of measuring")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                 "docs", "memory_by_stage.png"))
    a = p.parse_args()
    if a.json:
        with open(a.json) as f:
            raw = json.load(f)["raw"]["methods"]
    else:
        args = SimpleNamespace(d_model=128, layers=2, batch=8, seq=64, vocab=1000, lr=1e-3, seed=0, bucket_mb=25.0,
                               warmup=1, steps=1, rounds=1)
        raw = launch(body, args)["methods"]
    mem = {m: raw[m][-1]["memory"] for m in METHODS if m in raw and "memory" in raw[m][-1]}
    numel = next(raw[m][-1]["numel"] for m in mem)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = list(mem)
    x = range(len(ms))
    psi = lambda b: b / numel  # noqa: E731
    # stack: params (offloaded shards hatched), grads (full + shards), fp32 master, Adam state (hatched if offloaded)
    segs = []
    for m in ms:
        r = mem[m]
        off_opt = r.get("host", 0) > 0
        host_params = max(0, r.get("host", 0) - (r["master"] + r["optimizer_state"])) if off_opt else 0
        segs.append([(host_params, 0, True), (r["params"] - host_params, 0, False),
                     (r["grads"] + r["grad_shards"], 1, False), (r["master"], 2, off_opt),
                     (r["optimizer_state"], 3, off_opt)])
    names = ["params", "grads (full + shards)", "fp32 master (separate)", "Adam state"]
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    fig, ax = plt.subplots(figsize=(10, 5))
    bottom = [0.0] * len(ms)
    for j in range(5):
        for i, m in enumerate(ms):
            v, k, hatched = segs[i][j]
            if v <= 0:
                continue
            ax.bar(i, psi(v), 0.6, bottom=bottom[i], color=colors[k],
                   hatch="//" if hatched else None, edgecolor="k" if hatched else None, linewidth=0)
            bottom[i] += psi(v)
    for name, color in zip(names, colors):
        ax.bar([0], [0], color=color, label=name)  # legend proxies
    ax.bar([0], [0], color="w", hatch="//", edgecolor="k", linewidth=0, label="hatched: in host memory (offloaded)")
    floors = [method_floor(m, numel) for m in ms]
    ax.scatter(x, [psi(f["device"] + f["host"]) for f in floors], marker="_", s=900, color="k", zorder=5,
               label="model-state floor (device + host)")
    ax.scatter(x, [psi(f["device"]) for f in floors], marker="_", s=900, color="0.5", zorder=5,
               label="model-state floor, device only")
    for i, t in enumerate(bottom):
        ax.text(i, t + 0.2, f"{t:.1f}", ha="center", fontsize=9)
    ax.set_xticks(list(x), [LABELS[m] for m in ms])
    ax.set_ylabel("model-state bytes per rank / Psi")
    ax.set_title(f"Model states per rank, bench TinyLM (Psi={numel:,}), fp32 + AdamW, {WORLD_SIZE} ranks\n"
                 "measured after backward, before the step (engine.memory_report)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylim(0, max(bottom) * 1.15)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    for m, t, f in zip(ms, bottom, floors):
        print(f"{m:<14} measured {t:5.2f} Psi  floor {psi(f['device'] + f['host']):5.2f} Psi "
              f"(device {psi(f['device']):5.2f})")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
