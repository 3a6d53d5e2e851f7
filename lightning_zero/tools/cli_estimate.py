"""``lightning-zero estimate``: its arguments and what it runs (the estimator, ``estimate.py``; with
``--pipeline-parallel-size``, ``estimate_pipeline.py``; with ``--module``, one measured probe step)."""

from __future__ import annotations

import argparse

from .t5_dims import BYTE_VOCAB, RECIPE_VOCAB  # pure arithmetic: no torch import at CLI start-up


def _load_module(spec: str):
    """``pkg.mod:factory`` -> the module ``factory()`` returns, built on the meta device (no memory)."""
    import torch

    from .factory import call_factory

    with torch.device("meta"):
        return call_factory(spec)


def _estimate(args: argparse.Namespace) -> int:
    from .estimate import estimate_model_states
    from .estimate_knobs import check_knobs, parse_count

    check_knobs(probe_batch=args.probe_batch_size)
    if args.pipeline_parallel_size is None and (args.microbatches is not None or args.stage_params is not None):
        raise ValueError("--microbatches and --stage-params describe a pipeline. Allowed: with "
                         "--pipeline-parallel-size P.")
    probe = None
    if args.module:
        model = _load_module(args.module)
        if isinstance(model, tuple):  # (LightningModule, datamodule)
            model = model[0]
        cfg = getattr(model, "config", None)
        if args.batch_size is not None and getattr(cfg, "model_type", "") != "t5":
            probe = _probe(args)
    elif args.params:
        model = parse_count(args.params)
    else:
        model = args.model
    vocab = _vocab(args.vocab)
    if args.pipeline_parallel_size is not None:
        return _estimate_pipeline(args, model, vocab)
    est = estimate_model_states(
        model, world_size=args.ranks, num_nodes=args.nodes, precision=args.precision, optimizer=args.optimizer,
        bucket_mb=args.bucket_mb, grad_accumulation=args.grad_accum, batch_size=args.batch_size, src_len=args.src_len, tgt_len=args.tgt_len,
        device_memory_gb=args.device_memory, cpu_memory_gb=args.cpu_memory,
        settings=args.settings.split(",") if args.settings else None, vocab_size=vocab,
        shard_group_size=args.shard_group_size, activation_checkpointing=args.activation_checkpointing,
        offload_activations=args.offload_activations, tensor_parallel_size=args.tensor_parallel_size,
        activation_probe=probe, nvme_step_time=args.step_time, optimizer_state_dtype=args.optimizer_state_dtype,
        master_dtype=args.master_dtype)
    print(est)
    return 0


def _vocab(text: str):
    """--vocab: 'preset' (None: the preset's own) or a vocabulary size (checked with the other sizes)."""
    if text == "preset":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--vocab {text!r}: allowed 'preset' (the preset's own, 32128) or a vocabulary size, an "
                         f"int >= 1 ({RECIPE_VOCAB}: the recipe's subword tokenizer, {BYTE_VOCAB}: tokenizer=bytes).") \
            from None


def _probe(args: argparse.Namespace):
    """Activations of a non-T5 --module: one probe step of the factory's model, built for real on the CPU."""
    from .estimate_activations import probe_activations
    from .factory import call_factory

    made = call_factory(args.module)
    model, data = made if isinstance(made, tuple) else (made, None)
    return probe_activations(model, data, probe_batch=args.probe_batch_size, precision=args.precision,
                             seq_len=args.src_len)


def _estimate_pipeline(args: argparse.Namespace, model, vocab) -> int:
    from .estimate import info_from_t5, t5_dims
    from .estimate_pipeline import estimate_pipeline, format_pipeline_estimate

    name = args.module or args.params or args.model
    if isinstance(model, str):  # a recipe preset: its parameter count, cut evenly
        model = info_from_t5(t5_dims(model, vocab_size=vocab)).numel
    from .estimate_knobs import parse_count

    stage_params = [parse_count(x, "--stage-params") for x in args.stage_params.split(",")] \
        if args.stage_params else None
    print(format_pipeline_estimate(estimate_pipeline(
        model, args.ranks, args.pipeline_parallel_size, args.precision, args.optimizer, stage_params=stage_params,
        microbatches=args.microbatches, name=str(name))))
    return 0


def add_estimate(sub) -> None:
    p = sub.add_parser(
        "estimate", help="per-rank memory of every ZeRO stage x offload setting, and which fit",
        description="Device bytes per rank (model states from the floors of docs/ARCHITECTURE.md as the engine "
        "allocates them, plus its bucket / stage-3 unit buffers and, with --batch-size, activations: the T5 formula, "
        "or for another --module one measured probe step) and CPU RAM per node, for stages 0-3 with and without "
        "offload; below, every setting's model states at fp32 / bf16 moments / bf16 moments + masters. Nothing is "
        "run or allocated, but for the one probe step of a non-T5 --module with --batch-size. Memory sizes are GiB "
        "(2**30 bytes).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="t5_small",
                     help="a T5 preset of the recipe (conf/model: t5_tiny, t5_mini, t5_small, t5_base, t5_large, t5_3b)"
                     ", or HF's name of it (t5-3b, google-t5/t5-3b); any case")
    src.add_argument("--params", help="a parameter count instead (1.5e9, 350M, 7B)")
    src.add_argument("--module", help="package.module:factory returning an nn.Module (built on the meta device)")
    p.add_argument("--vocab", default=str(RECIPE_VOCAB),
                   help=f"T5 vocabulary size: {RECIPE_VOCAB} = the recipe's subword tokenizer (default), "
                   f"{BYTE_VOCAB} = its tokenizer=bytes, 'preset' = the preset's own (32128)")
    p.add_argument("--ranks", type=int, default=1, help="total number of ranks (world size)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (CPU RAM is per node)")
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "16-mixed"])
    p.add_argument("--optimizer", default="adamw",
                   help="adamw, adam (K=8 B/param), sgd (0), sgd_momentum, rmsprop, adagrad (4), ...; whole-tensor "
                   "(state by shape, on owner ranks; a module or T5 preset): muon (+ AdamW on the rest), adafactor")
    p.add_argument("--optimizer-state-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="strategy.optimizer_state_dtype: the optimizer's per-element state (Adam's moments) kept in "
                   "bf16 between steps (the table's rows; every setting at fp32 / bf16 moments / bf16 moments + "
                   "masters is listed below it)")
    p.add_argument("--master-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="strategy.master_dtype: the master in bf16 plus a bf16 compensation term (needs --precision "
                   "bf16-mixed)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="strategy.bucket_mb")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="gradient accumulation steps (> 1: stage 1 keeps full gradients between micro-batches)")
    p.add_argument("--batch-size", type=int, default=None, help="micro-batch per rank: activations (T5: formula; "
                   "another --module: one measured probe step, scaled linearly)")
    p.add_argument("--probe-batch-size", type=int, default=2, help="micro-batch of the measured probe step "
                   "(--module, not T5; its model is built for real on the CPU once)")
    p.add_argument("--src-len", type=int, default=512, help="source tokens per sample (probe of an HF --module: "
                   "its sequence length)")
    p.add_argument("--tgt-len", type=int, default=128, help="target tokens per sample")
    p.add_argument("--device-memory", type=float, default=None, metavar="GB", help="memory per device: say what fits")
    p.add_argument("--cpu-memory", type=float, default=None, metavar="GB", help="CPU RAM per node (with --device-memory)")
    p.add_argument("--settings", default=None, help="comma list of settings to show (zero0, zero1, zero1_offload, "
                   "zero2, zero2_offload, zero3, zero3_offload, zero2_offload_nvme, zero3_offload_nvme; default: all)")
    p.add_argument("--step-time", type=float, default=1.0, metavar="S",
                   help="the optimizer step time (s) the NVMe rows' needed disk bandwidth is given for")
    p.add_argument("--shard-group-size", type=int, default=None, metavar="K",
                   help="hybrid sharding: shard over groups of K ranks (e.g. GPUs per node); also shows K = ranks")
    p.add_argument("--tensor-parallel-size", type=int, default=None, metavar="T",
                   help="tensor parallelism: T5 attention q/k/v/o and FFN wi/wo cut T ways, states over N/T ranks")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="activations with strategy.activation_checkpointing=auto (every T5Block recomputed)")
    p.add_argument("--offload-activations", action="store_true",
                   help="activations with strategy.offload_activations=true (saved tensors in host memory)")
    p.add_argument("--pipeline-parallel-size", type=int, default=None, metavar="P",
                   help="per pipeline stage instead: the model-state bytes of one rank of each of P stages at ZeRO "
                   "0/1/2 (each stage sharded over its --ranks / P replicas)")
    p.add_argument("--stage-params", default=None, help="with --pipeline-parallel-size: parameters per stage, "
                   "comma separated (40M,42M); default: GPT-2 blocks split evenly for a --module GPT-2, else Psi / P")
    p.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help="with --pipeline-parallel-size: also print the bubble fraction (P - 1) / (M + P - 1)")
    p.set_defaults(func=_estimate)
