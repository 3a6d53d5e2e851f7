"""Full vs trainable-only checkpoints of a LoRA fine-tune (issue 46): bytes on disk and how long a save stops
training, per stage ([Note: trainable-only checkpoints] in lightning_zero/checkpoint/trainable_only.py).

GPT-2 from its config (vocab 8192, n_embd 512, 6 layers: 23.9M parameters, random init, written with
``save_pretrained``: nothing downloaded), wrapped by peft with LoRA r=8 on ``c_attn`` and ``c_fc``, torch
AdamW, 2 gloo ranks, one thread each. Per stage: one training step, then ``save_engine_checkpoint`` timed
(barrier to barrier) -- first a trainable-only save (the run's first: the base is hashed), then ``--repeats``
pairs of full / trainable-only saves, each after another step. Columns: the median save time and the
directory's bytes.

    PYTHONPATH=. python bench/trainable_only.py [--stages 0,2,3] [--repeats 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import print_and_dump
from lightning_zero.checkpoint.format import save_engine_checkpoint
from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.tools.launch import run_ranks


def _config():
    import transformers

    return transformers.GPT2Config(vocab_size=8192, n_positions=64, n_embd=512, n_layer=6, n_head=8)


def _rank(rank: int, world: int, root: str, stage: int, repeats: int) -> dict:
    import peft
    import transformers

    torch.set_num_threads(1)
    base = Path(root) / "base"
    model = transformers.GPT2LMHeadModel.from_pretrained(str(base))
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_fc"],
                                                       fan_in_fan_out=True))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine = ZeroEngine(model, opt, ZeroConfig(stage=stage))
    ids = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(rank))
    times: dict[str, list[float]] = {}
    for i, kind in enumerate(["trainable"] + ["full", "trainable"] * repeats):
        model(input_ids=ids, labels=ids).loss.backward()
        engine.step()
        torch.distributed.barrier()
        t = time.perf_counter()
        save_engine_checkpoint(Path(root) / f"{kind}{stage}", model, engine,
                               trainable_only_base=str(base) if kind == "trainable" else None)
        torch.distributed.barrier()
        times.setdefault(kind if i else "first", []).append(time.perf_counter() - t)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="0,2,3")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    t0 = time.perf_counter()
    import transformers

    root = Path(tempfile.mkdtemp(prefix="trainable_only_bench"))
    try:
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(_config()).save_pretrained(str(root / "base"))
        lines = ["stage | full save s | trainable-only save s (first: hashes the base) | full bytes | trainable-only bytes",
                 "---|---|---|---|---"]
        rows = []
        for stage in map(int, args.stages.split(",")):
            times = run_ranks(_rank, 2, (str(root), stage, args.repeats), start_method="fork")[0]
            size = {k: sum(f.stat().st_size for f in (root / f"{k}{stage}").rglob("*") if f.is_file())
                    for k in ("full", "trainable")}
            row = {"stage": stage, "full_s": statistics.median(times["full"]),
                   "trainable_s": statistics.median(times["trainable"]), "first_s": times["first"][0],
                   "full_bytes": size["full"], "trainable_bytes": size["trainable"]}
            rows.append(row)
            lines.append(f"{stage} | {row['full_s']:.3f} | {row['trainable_s']:.3f} ({row['first_s']:.3f}) | "
                         f"{size['full']:,} | {size['trainable']:,} ({size['trainable'] / size['full']:.1%})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_and_dump(lines, t0, args, {"rows": rows})


if __name__ == "__main__":
    main()
