"""1-bit Adam and 0/1 Adam against AdamW at equal steps: GPT-2 from config on 2 gloo ranks (1 thread each).

Every method trains the same GPT-2 (random init from a config, no download) on the same stream: token
sequences of a fixed random bigram chain (learnable: the loss falls from ln(vocab) toward the chain's
entropy), each rank its own batches, the same held-out batches for the validation loss. Methods:

- ``adamw_ddp``: torch DDP + torch AdamW (step time reference; bytes: the ring all-reduce of every fp32 grad);
- ``adamw_zero0``: AdamW on lightning_zero's stage 0 (its bytes from ``comm_report()``);
- ``onebit``: ``OneBitAdam(freeze_step=F)`` on stage 0;
- ``zeroone``: ``ZeroOneAdam(var_freeze_step=F, ...)`` on stage 0;
- ``adamw_zero1``: AdamW on stage 1 (state sharded: reduce-scatter + parameter all-gather);
- ``onebit_zero1``: ``OneBitAdam(freeze_step=F)`` on stage 1 (compressed reduce-scatter, compressed all-gather
  of the momentum, parameter all-gather).

Reported per method: final val loss, wire bytes per step (this rank) after the warmup and their ratio to DDP,
median step time after the warmup. Run::

    python bench/onebit_adam.py                 # 300 steps, freeze at 60: a few minutes on 2 cores
    python bench/onebit_adam.py --steps 100 --freeze 20
    python bench/onebit_adam.py --methods adamw_zero1,onebit_zero1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, SEQ, BATCH = 512, 64, 8
STAGES = {"adamw_zero0": 0, "onebit": 0, "zeroone": 0, "adamw_zero1": 1, "onebit_zero1": 1}  # else: torch DDP


def gpt2():
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def bigram_batch(seed: int) -> torch.Tensor:
    """A batch of sequences of one fixed random bigram chain (each token has 4 likely successors)."""
    table = torch.Generator().manual_seed(1234)
    nxt = torch.randint(0, VOCAB, (VOCAB, 4), generator=table)
    g = torch.Generator().manual_seed(seed)
    toks = torch.empty(BATCH, SEQ, dtype=torch.long)
    toks[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
    for t in range(1, SEQ):
        toks[:, t] = nxt[toks[:, t - 1], torch.randint(0, 4, (BATCH,), generator=g)]
    return toks


def make_optimizer(method: str, params, args):
    from lightning_zero.optim import OneBitAdam, ZeroOneAdam

    if method.startswith("onebit"):
        return OneBitAdam(params, lr=args.lr, freeze_step=args.freeze)
    if method == "zeroone":
        return ZeroOneAdam(params, lr=args.lr, var_freeze_step=args.freeze, var_update_scaler=8,
                           local_step_scaler=max(1, args.steps // 8), local_step_clipper=4)
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)


def body(rank: int, world: int, method: str, args) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_zero.engine import ZeroConfig, ZeroEngine

    model = gpt2()
    n_params = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(method, model.parameters(), args)
    engine, ddp = None, None
    if method == "adamw_ddp":
        ddp = DDP(model)
    else:
        engine = ZeroEngine(model, opt, ZeroConfig(stage=STAGES[method]))
    run = ddp if ddp is not None else model
    times, wire = [], []
    for step in range(1, args.steps + 1):
        toks = bigram_batch(10_000 * rank + step)
        t0 = time.perf_counter()
        loss = run(toks, labels=toks).loss
        loss.backward()
        if engine is not None:
            engine.step()
            wire.append(engine.comm_report().wire_bytes)
        else:
            opt.step()
            opt.zero_grad()
            wire.append(int(2 * (world - 1) / world * 4 * n_params))  # DDP's ring all-reduce of fp32 grads
        times.append(time.perf_counter() - t0)
    model.eval()
    with torch.no_grad():
        val = statistics.fmean(model(t, labels=t).loss.item() for t in (bigram_batch(-1 - i) for i in range(8)))
    after = slice(args.freeze + 1, None)  # 0/1 Adam still syncs variance some steps before its freeze
    report = engine.comm_report() if engine is not None else None
    # a compressed optimizer's phases; AdamW's last step by collective (a stage-1 step: reduce-scatter + all-gather)
    detail = "" if report is None else report.phase_table() if report.phases else report.table()
    return dict(val=val, wire=statistics.fmean(wire[after]), time=statistics.median(times[after]),
                n_params=n_params, phases=detail if method != "adamw_zero0" else "")


def main() -> None:
    from lightning_zero.tools.launch import run_ranks

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--freeze", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--methods", default="adamw_ddp,adamw_zero0,onebit,zeroone,adamw_zero1,onebit_zero1")
    args = ap.parse_args()
    rows = {}
    methods = args.methods.split(",")
    unknown = [m for m in methods if m != "adamw_ddp" and m not in STAGES]
    if unknown:
        ap.error(f"unknown method(s) {', '.join(unknown)}: allowed adamw_ddp, {', '.join(STAGES)}")
    for method in methods:
        t0 = time.perf_counter()
        rows[method] = run_ranks(body, 2, (method, args), timeout_s=3600)[0]
        print(f"{method}: {time.perf_counter() - t0:.0f} s", flush=True)
    base = rows.get("adamw_ddp") or rows[next(iter(rows))]
    ref_val = rows.get("adamw_zero0", base)["val"]
    print(f"\nGPT-2 from config ({base['n_params'] / 1e6:.2f} M params), 2 gloo ranks x 1 thread, {args.steps} steps, "
          f"freeze at {args.freeze}, lr {args.lr}\n")
    print("| method | final val loss | vs AdamW | wire B/step after warmup | vs DDP | step time (median) | vs DDP |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for m, r in rows.items():
        print(f"| {m} | {r['val']:.4f} | {100 * (r['val'] / ref_val - 1):+.2f}% | {r['wire']:,.0f} | "
              f"1/{base['wire'] / r['wire']:.1f} | {1000 * r['time']:.1f} ms | {r['time'] / base['time']:.2f}x |")
    for m, r in rows.items():
        if r["phases"]:
            what = "phases" if "phase |" in r["phases"] else "last step"
            print(f"\n{m} (rank 0, comm_report {what}):\n{r['phases']}")


if __name__ == "__main__":
    main()
