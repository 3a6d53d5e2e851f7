"""Bytes on the wire per training step: DDP, our stages, and ZeRO++'s int8 collectives, 2 gloo ranks.

For each method one fresh model (``harness.TinyLM``, or HF T5 with ``--t5 small``) takes ``--steps``
steps; the last step's traffic is reported from ``engine.comm_report()`` (by collective and group:
payload bytes and the bytes this rank sends under the ring algorithms). DDP's own all-reduces do not go
through lightning_zero: its row is measured with a DDP communication hook that counts every bucket it
all-reduces (the same ring accounting). Methods run one after another (comm_report's counters are per
process), so no interleaving is needed: bytes do not depend on the machine's load.

Run::

    python bench/comm_bytes.py                      # TinyLM defaults, seconds
    python bench/comm_bytes.py --t5 small           # HF T5-small shapes (60.5 M params), random init
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import add_model_args, build, launch, loss_of, make_batches, make_tiny_lm  # noqa: E402

METHODS = ("ddp", "zero0", "zero2", "zero2_blocking", "zero2_q", "zero3", "zero3_q")


def _t5_model(size: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    dims = {"small": dict(d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64),
            "tiny": dict(d_model=64, d_ff=128, num_layers=2, num_heads=2, d_kv=32)}[size]
    cfg = transformers.T5Config(vocab_size=32128, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                                feed_forward_proj="relu", **dims)
    return transformers.T5ForConditionalGeneration(cfg)


class _T5LossModel(torch.nn.Module):
    """T5 with TinyLM's call signature (tokens -> logits), so the harness' loss and builders apply."""

    def __init__(self, size: str) -> None:
        super().__init__()
        self.t5 = _t5_model(size)

    def forward(self, tokens):
        return self.t5(input_ids=tokens, decoder_input_ids=tokens).logits


def _ddp_counter(state, bucket):
    n = dist.get_world_size()
    nbytes = bucket.buffer().numel() * bucket.buffer().element_size()
    state["calls"] += 1
    state["payload"] += nbytes
    state["wire"] += int(nbytes * 2 * (n - 1) / n)
    fut = dist.all_reduce(bucket.buffer().div_(n), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def body(rank: int, args) -> dict:
    make = (lambda a: _T5LossModel(args.t5)) if args.t5 else make_tiny_lm
    block = None
    if args.t5:
        from transformers.models.t5.modeling_t5 import T5Block

        block = T5Block
    batches = make_batches(args.steps, rank, args.batch, args.seq, args.vocab)
    out = {}
    for m in args.methods:
        kw = dict(make_model=make)
        if block is not None:
            kw["block_class"] = block
        r = build(m, args, **kw)
        state = {"calls": 0, "payload": 0, "wire": 0}
        if m == "ddp":
            r.module.register_comm_hook(state, _ddp_counter)
        for i, x in enumerate(batches):
            if m == "ddp" and i == len(batches) - 1:
                state.update(calls=0, payload=0, wire=0)  # the last step only, like comm_report
            r.pre()
            r.backward(loss_of(r.module, x, args.vocab))
            r.step()
        if r.engine is not None:
            rep = r.engine.comm_report()
            out[m] = {"rows": {f"{op}@{g}": v for (op, g), v in rep.rows.items()},
                      "payload": rep.payload_bytes, "wire": rep.wire_bytes, "numel": r.numel}
            r.engine.remove()
        else:
            out[m] = {"rows": {"all_reduce@ddp": [state["calls"], state["payload"], state["wire"]]},
                      "payload": state["payload"], "wire": state["wire"], "numel": r.numel}
        dist.barrier()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--t5", choices=("tiny", "small"), default=None, help="HF T5 shapes instead of TinyLM")
    p.add_argument("--methods", default=",".join(METHODS))
    args = p.parse_args()
    args.methods = [m for m in args.methods.split(",") if m]
    if args.t5:
        args.vocab = 32128
    res = launch(body, args, start_method="fork")
    numel = next(iter(res.values()))["numel"]
    base = res.get("ddp", {}).get("wire")
    print(f"model: {'T5-' + args.t5 if args.t5 else 'TinyLM'}, Psi={numel:,} params, fp32, 2 gloo ranks, "
          f"bucket {args.bucket_mb} MiB; last of {args.steps} steps; bytes this rank sends per step")
    print("| method | wire B/step | (Psi) | vs DDP | payload B/step | by collective (calls, wire B) |")
    print("|---|---:|---:|---:|---:|---|")
    for m, r in res.items():
        detail = "; ".join(f"{k} x{v[0]} {v[2]:,}" for k, v in sorted(r["rows"].items()))
        ratio = f"{r['wire'] / base:.3f}" if base else "-"
        print(f"| {m} | {r['wire']:,} | {r['wire'] / numel:.2f} | {ratio} | {r['payload']:,} | {detail} |")


if __name__ == "__main__":
    main()
