"""Pipeline parallelism x ZeRO-1: step time, memory per rank and the measured bubble, against DDP and ZeRO-3.

Four gloo ranks, an HF GPT-2 (untied head, SDPA). Methods, all on the same global batch:

* ``ddp``      -- torch DDP over 4 ranks (each rank a quarter of the batch);
* ``zero3``    -- ``ZeroEngine(ZeroConfig(stage=3))`` over 4 ranks, one unit per GPT-2 block;
* ``pp2_mM``   -- ``PipelineZero`` with P = 2 stages x D = 2 replicas, ZeRO-1 inside each stage, 1F1B over
  M micro-batches (M = 2, 4, 8);
* ``pp2i_mM``  -- the same with interleaved 1F1B, V = 2 chunks per rank (4 stages on 2 pipeline ranks).

Per method: the median step time (the slower rank's, after a warm-up step), the model-state bytes per rank
(the ZeRO floor of what the rank holds: its stage's parameters only, under pipelining), the peak bytes of
tensors saved for backward (activations; counted by ``saved_tensors_hooks``, a tensor saved twice counts
twice -- the same rule for every method). No RSS: one process runs every method, and its peak is
monotonic. Bubble: each pipeline rank times its stage's
forward and backward chunks (torch's ``forward_one_chunk`` / ``backward_one_chunk``, which exclude waiting
for a peer); ``1 - busy / step`` averaged over the ranks, next to (P - 1) / (V M + P - 1) (V = 1 unless
interleaved), which assumes free communication and equal stages.

Run::

    python bench/pipeline.py                    # ~30 s on 2 loaded cores
    python bench/pipeline.py --d-model 256 --layers 8 --steps 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_zero.engine import ZeroConfig, ZeroEngine  # noqa: E402
from lightning_zero.engine.memory.floors import model_state_floor  # noqa: E402
from lightning_zero.engine.pipeline.pipeline_zero import PipelineZero, bubble_fraction, pipeline_layout, virtual_stages  # noqa: E402
from lightning_zero.engine.pipeline.split import split_gpt2  # noqa: E402
from lightning_zero.tools.launch import run_ranks  # noqa: E402

WORLD, P = 4, 2


class SavedBytes:
    """Live and peak bytes of tensors autograd saved for backward (freed with the graph)."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def hooks(self):
        meter = self

        class Holder:
            def __init__(self, t):
                self.t, self.n = t, t.numel() * t.element_size()
                meter.live += self.n
                meter.peak = max(meter.peak, meter.live)

            def __del__(self):
                meter.live -= self.n

        return torch.autograd.graph.saved_tensors_hooks(Holder, lambda h: h.t)


def _model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.d_model, n_layer=args.layers,
                     n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
                     bos_token_id=None, eos_token_id=None)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg)


def _loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)


def _batches(args):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(args.steps + 1)]


def _flat(rank, method, args, batches):
    model = _model(args)
    numel = sum(p.numel() for p in model.parameters())
    opt = _adamw(model.parameters())
    if method == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped, engine, floor = DDP(model), None, model_state_floor(0, numel, WORLD, False)
    else:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        engine = ZeroEngine(model, opt, ZeroConfig(stage=3, unit_classes=[GPT2Block]))
        wrapped, floor = model, model_state_floor(3, numel, WORLD, False)
    rows = args.batch // WORLD
    meter, times = SavedBytes(), []

    def step(ids):
        ids = ids[rank * rows:(rank + 1) * rows]
        if engine is not None:
            engine.prepare_forward()
        with meter.hooks():
            loss = _loss(wrapped(ids).logits, ids)
        loss.backward()
        if engine is not None:
            engine.step()
        else:
            opt.step()
            opt.zero_grad()

    for i, ids in enumerate(batches):
        dist.barrier()
        t0 = time.perf_counter()
        step(ids)
        if i:
            times.append(time.perf_counter() - t0)
    if engine is not None:
        engine.remove()
    return times, floor["device"], meter.peak, None


def _pipelined(rank, m, chunks, args, batches):
    lay = pipeline_layout(P)
    model = _model(args)
    modules = [split_gpt2(model, P * chunks, i) for i in virtual_stages(lay.stage_index, P, chunks)]
    opts = [_adamw(mod.parameters()) for mod in modules]
    pipe = PipelineZero(modules if chunks > 1 else modules[0], P, _loss, opts if chunks > 1 else opts[0], m,
                        schedule="interleaved" if chunks > 1 else "1f1b", config=ZeroConfig(stage=1))
    numel = sum(p.numel() for mod in modules for p in mod.parameters())
    meter, busy = SavedBytes(), [0.0]
    for stage in pipe.pipe_stages:
        for name in ("forward_one_chunk", "backward_one_chunk"):
            real = getattr(stage, name)

            def timed(*a, _real=real, **k):
                t0 = time.perf_counter()
                try:
                    with meter.hooks():
                        return _real(*a, **k)
                finally:
                    busy[0] += time.perf_counter() - t0

            setattr(stage, name, timed)
    rows = args.batch // lay.dp_size
    times, bubbles = [], []
    for i, ids in enumerate(batches):
        ids = ids[lay.dp_rank * rows:(lay.dp_rank + 1) * rows]
        dist.barrier()
        busy[0] = 0.0
        t0 = time.perf_counter()
        pipe.step(ids, ids)
        dt = time.perf_counter() - t0
        if i:
            times.append(dt)
            bubbles.append(1 - busy[0] / dt)
    return times, model_state_floor(1, numel, lay.dp_size, False)["device"], meter.peak, statistics.mean(bubbles)


def _body(rank, world_size, args):
    batches = _batches(args)
    out = {}
    for method in args.methods:
        if method.startswith("pp2"):
            chunks = 2 if method.startswith("pp2i") else 1
            res = _pipelined(rank, int(method.split("_m")[1]), chunks, args, batches)
        else:
            res = _flat(rank, method, args, batches)
        t = torch.tensor(res[0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
        out[method] = dict(step_ms=1e3 * statistics.median(t.tolist()), states=res[1], saved=res[2],
                           bubble=res[3])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per method (after one warm-up step)")
    p.add_argument("--methods", default="ddp,zero3,pp2_m2,pp2_m4,pp2_m8,pp2i_m4")
    args = p.parse_args()
    args.methods = args.methods.split(",")
    t0 = time.perf_counter()
    ranks = run_ranks(_body, WORLD, (args,), timeout_s=900)
    print(f"GPT-2 d_model={args.d_model} layers={args.layers} seq={args.seq} vocab={args.vocab}, global batch "
          f"{args.batch}, {WORLD} gloo ranks (1 thread each), fp32 AdamW; {args.steps} timed steps")
    print("| method | step ms (median) | model states / rank MiB (max) | saved activations / rank MiB (max) "
          "| bubble measured | (P-1)/(VM+P-1) |")
    print("|---|---|---|---|---|---|")
    for m in args.methods:
        rows = [r[m] for r in ranks]
        bub = [r["bubble"] for r in rows if r["bubble"] is not None]
        measured = f"{statistics.mean(bub):.2f}" if bub else "-"
        v = 2 if m.startswith("pp2i") else 1
        formula = f"{bubble_fraction(P, v * int(m.split('_m')[1])):.2f}" if m.startswith("pp2") else "-"
        print(f"| {m} | {rows[0]['step_ms']:.0f} | {max(r['states'] for r in rows) / 2**20:.2f} | "
              f"{max(r['saved'] for r in rows) / 2**20:.2f} | {measured} | {formula} |")
    print(f"wall {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
