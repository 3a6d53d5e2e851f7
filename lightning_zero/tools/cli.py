"""``lightning-zero`` console command. Subcommands: ``consolidate``, ``export``, ``estimate``, ``tune``,
``from-deepspeed``.

    lightning-zero consolidate CKPT_DIR OUT [--dtype fp32|bf16|fp16] [--lightning [--optimizer]] [--quiet]
                               [--trust-checkpoint]
    lightning-zero export CKPT_DIR OUTDIR --hf [--prefix model.] [--config DIR_or_config.json] [--trust-checkpoint]
    lightning-zero estimate --model t5_large --ranks 8 --precision bf16-mixed --batch-size 8 --device-memory 24
    lightning-zero estimate --params 1.5e9 --ranks 16 --nodes 2 --optimizer sgd
    lightning-zero estimate --params 1.5e9 --ranks 8 --pipeline-parallel-size 2 --microbatches 8
    lightning-zero tune --memory-mb 12 --out tuned.overrides model=t5_tiny trainer.devices=2
    lightning-zero tune --module my_pkg.models:build --memory-mb 900 --devices 2 --stages 2,3
    lightning-zero from-deepspeed ds_config.json --world-size 2 --out ds.overrides
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .t5_dims import BYTE_VOCAB, RECIPE_VOCAB  # pure arithmetic: no torch import at CLI start-up

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _consolidate(args: argparse.Namespace) -> int:
    import torch

    from ..checkpoint.consolidate import consolidate, stored_nbytes
    from ..checkpoint.files import read_info, resolve_checkpoint_dir
    from ..checkpoint.pipeline_dir import is_pipeline_checkpoint
    from .progress import byte_progress

    if args.optimizer and not args.lightning:
        raise ValueError("--optimizer needs --lightning (a plain state dict holds the weights only).")
    dtype = getattr(torch, _DTYPES[args.dtype])
    if is_pipeline_checkpoint(resolve_checkpoint_dir(args.ckpt_dir)):
        return _consolidate_pipeline(args, dtype)
    # the Trainer's checks (checksums, the json against DCP's metadata) before anything is written
    total = stored_nbytes(read_info(resolve_checkpoint_dir(args.ckpt_dir), args.trust_checkpoint), dtype)
    with byte_progress(total, "consolidate", args.quiet) as progress:
        if args.lightning:
            from ..lightning.lightning_io import write_lightning_checkpoint

            info = write_lightning_checkpoint(args.ckpt_dir, args.out, optimizer=args.optimizer, dtype=dtype,
                                              progress=progress, trust_checkpoint=args.trust_checkpoint)
        else:
            info = consolidate(args.ckpt_dir, args.out, dtype=dtype, progress=progress,
                               trust_checkpoint=args.trust_checkpoint)
    what = " (Lightning checkpoint" + (", with optimizer state)" if info.get("optimizer") else ", weights only)") \
        if args.lightning else ""
    print(f"wrote {info['tensors']} tensors ({info['bytes'] / 2**20:.1f} MiB) to {args.out}{what}")
    return 0


def _consolidate_pipeline(args: argparse.Namespace, dtype) -> int:
    """A pipeline checkpoint (a sharded directory per stage): the uncut model's state dict, as DDP over it would save."""
    from ..checkpoint.files import resolve_checkpoint_dir
    from ..checkpoint.pipeline_dir import write_consolidated

    if args.lightning:
        raise ValueError("--lightning is not available for a pipeline checkpoint: its weights consolidate under "
                         "the uncut model's names, not the LightningModule's stage modules. Allowed: a plain "
                         "state dict (OUT .pt or .safetensors) that loads into the uncut model with strict=True.")
    info = write_consolidated(resolve_checkpoint_dir(args.ckpt_dir), args.out, dtype, args.trust_checkpoint)
    print(f"wrote {info['tensors']} tensors ({info['bytes'] / 2**20:.1f} MiB) to {args.out} (pipeline "
          f"checkpoint: every stage's weights under the uncut model's names)")
    return 0


def _export(args: argparse.Namespace) -> int:
    import torch

    from .export_hf import export_hf

    if not args.hf:
        raise ValueError("export needs a target format; allowed: --hf (a transformers save_pretrained directory).")
    res = export_hf(args.ckpt_dir, args.out_dir, prefix=args.prefix, config=args.config,
                    dtype=getattr(torch, _DTYPES[args.dtype]), quiet=args.quiet, trust_checkpoint=args.trust_checkpoint)
    print(f"wrote {res['tensors']} tensors ({res['bytes'] / 2**20:.1f} MiB) of {res['class']} (prefix "
          f"{res['prefix']!r}) to {res['out']}: {res['class']}.from_pretrained({res['out']!r})")
    return 0


def _add_export(sub) -> None:
    p = sub.add_parser(
        "export", help="write a transformers save_pretrained directory from a sharded checkpoint directory",
        description="Write OUTDIR/model.safetensors + config.json from a sharded checkpoint of a LightningModule "
        "holding a transformers model: the checkpoint names under --prefix (found when unambiguous) must be "
        "exactly the keys of the model class built from the config (missing, unexpected or mis-shaped keys are "
        "an error), so from_pretrained(OUTDIR) loads every weight. Runs on CPU in one process.")
    p.add_argument("ckpt_dir", help="checkpoint directory written by ZeroStrategy / trainer.save_checkpoint")
    p.add_argument("out_dir", help="output directory (created)")
    p.add_argument("--hf", action="store_true", help="transformers format (the one export format)")
    p.add_argument("--prefix", default=None, help="attribute path of the HF model in the LightningModule, with "
                   "the dot (e.g. 'model.'; '' when the module is the model); default: found from the keys")
    p.add_argument("--config", default=None, help="config.json or a directory holding it; default: a transformers "
                   "config among the checkpoint's hyper-parameters")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="dtype of floating tensors")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_trust(p)
    p.set_defaults(func=_export)


def _add_trust(p) -> None:
    p.add_argument("--trust-checkpoint", action="store_true", help="read the checkpoint's pickles (meta.pt, DCP's "
                   ".metadata) unrestricted, which can run code from the file: only for a checkpoint you trust "
                   "that the default restricted reader refuses (docs/security.md)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-zero", description="lightning_zero utilities")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "consolidate",
        help="write one full model state dict from a sharded checkpoint directory",
        description="Write the full model state dict of a sharded (DCP) checkpoint directory to OUT: "
        "torch.save, or safetensors when OUT ends with .safetensors; with --lightning a Lightning checkpoint "
        "file. Runs on CPU in one process; the optimizer state is read only with --optimizer. The state dict "
        "loads into the plain model with strict=True.",
    )
    p.add_argument("ckpt_dir", help="checkpoint directory written by ZeroStrategy / trainer.save_checkpoint")
    p.add_argument("out", help="output file (.pt/.ckpt/.bin: torch.save; .safetensors: safetensors)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="dtype of floating tensors")
    p.add_argument("--lightning", action="store_true", help="write a Lightning checkpoint (state_dict, "
                   "hyper_parameters, loops, pytorch-lightning_version) for LightningModule.load_from_checkpoint")
    p.add_argument("--optimizer", action="store_true", help="with --lightning: include the optimizer and LR "
                   "scheduler states, so Trainer(strategy='ddp').fit(ckpt_path=OUT) resumes the run")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_trust(p)
    p.set_defaults(func=_consolidate)
    _add_export(sub)
    _add_estimate(sub)
    _add_tune(sub)
    _add_from_deepspeed(sub)
    return parser


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
        activation_probe=probe, nvme_step_time=args.step_time)
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


def _add_estimate(sub) -> None:
    p = sub.add_parser(
        "estimate", help="per-rank memory of every ZeRO stage x offload setting, and which fit",
        description="Device bytes per rank (model states from the floors of docs/ARCHITECTURE.md as the engine "
        "allocates them, plus its bucket / stage-3 unit buffers and, with --batch-size, activations: the T5 formula, "
        "or for another --module one measured probe step) and CPU RAM per node, for stages 0-3 with and without "
        "offload. Nothing is run or allocated, but for the one probe step of a non-T5 --module with --batch-size. "
        "Memory sizes are GiB (2**30 bytes).")
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
                   help="adamw, adam (K=8 B/param), sgd (0), sgd_momentum, rmsprop, adagrad (4), ...")
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


def _tune(args: argparse.Namespace) -> int:
    if args.module:
        return _tune_module(args)
    if args.memory_mb is None and args.memory_gb is None:
        raise ValueError("the recipe tune needs a cap: --memory-mb or --memory-gb.")
    for flag in ("devices", "precision", "accelerator", "mode", "steps_per_trial", "init_val", "max_trials",
                 "batch_arg_name"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} is a --module option; the recipe takes it from its "
                             "Hydra overrides (trainer.devices=..., trainer.precision=...).")
    from .tuning import tune

    res = tune(args.overrides, memory_mb=args.memory_mb, memory_gb=args.memory_gb, out=args.out,
               config_dir=args.config_dir, config_name=args.config_name, stages=args.stages,
               offload=args.offload, max_batch=args.max_batch, steps=args.steps, warmup=args.warmup,
               bisect_tol=args.bisect_tol, start_method=args.start_method, json_out=args.json,
               recipe=args.recipe, activations=args.activations)
    print(res.report())
    return 0 if res.best is not None else 1


def _tune_module(args: argparse.Namespace) -> int:
    from .tuning.module_tune import tune_module

    if args.overrides:
        raise ValueError(f"Hydra overrides ({' '.join(args.overrides)}) belong to the recipe tune; with --module "
                         "use --devices, --precision, --stages, --offload.")
    res = tune_module(args.module, memory_mb=args.memory_mb, memory_gb=args.memory_gb, devices=args.devices or 1,
                      stages=args.stages, offload=args.offload, precision=args.precision or "32-true",
                      accelerator=args.accelerator or "auto", mode=args.mode or "binsearch",
                      steps_per_trial=args.steps_per_trial or 3, init_val=args.init_val or 2,
                      max_trials=args.max_trials or 25, max_val=args.max_batch,
                      batch_arg_name=args.batch_arg_name or "batch_size", start_method=args.start_method,
                      json_out=args.json)
    print(res.report())
    return 0 if res.best is not None else 1


def _add_tune(sub) -> None:
    p = sub.add_parser(
        "tune", help="fastest stage x offload x micro-batch that fits, measured, for the Hydra T5 recipe",
        description="Compose the recipe's Hydra config (conf/t5_finetune.yaml + OVERRIDES), then for every "
        "stage x offload setting find the largest micro-batch that fits the memory cap (doubling, then "
        "bisection; GPU: real out-of-memory under a per-process memory fraction, CPU: the measured peak "
        "against a byte budget), time a few training steps of each, print the ranked table and write the "
        "winner's overrides (one per line) to --out: python examples/t5_finetune.py $(cat tuned.overrides). "
        "With --module pkg.mod:factory (any LightningModule, or (module, datamodule)): per preset, the largest "
        "micro-batch lightning_zero.ZeroBatchSizeFinder finds under the cap on --devices ranks.")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the experiment, e.g. model=t5_small trainer=gpu")
    p.add_argument("--module", default=None, help="package.module:factory returning a LightningModule or "
                   "(LightningModule, LightningDataModule): search its batch size instead of the T5 recipe")
    g = p.add_argument_group("--module options")
    g.add_argument("--devices", type=int, default=None, help="ranks on this node (default 1)")
    g.add_argument("--precision", default=None, choices=["32-true", "bf16-mixed", "16-mixed"], help="default 32-true")
    g.add_argument("--accelerator", default=None, choices=["auto", "cpu", "gpu", "cuda"], help="default auto")
    g.add_argument("--mode", default=None, choices=["power", "binsearch"], help="default binsearch")
    g.add_argument("--steps-per-trial", type=int, default=None, help="training steps per candidate (default 3)")
    g.add_argument("--init-val", type=int, default=None, help="first batch size tried (default 2)")
    g.add_argument("--max-trials", type=int, default=None, help="candidates at most (default 25)")
    g.add_argument("--batch-arg-name", default=None, help="the attribute holding the batch size (default batch_size)")
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--memory-gb", type=float, help="memory cap per rank in GiB (required but with --module on a GPU)")
    cap.add_argument("--memory-mb", type=float, help="memory cap per rank in MiB")
    p.add_argument("--out", default="tuned.overrides", help="file for the winning overrides")
    p.add_argument("--config-dir", default=None, help="the recipe's conf/ (default: ./conf or the repo's)")
    p.add_argument("--config-name", default="t5_finetune")
    p.add_argument("--recipe", default=None, help="the recipe (module name or .py file with validate_schema, "
                   "strategy_kwargs, tune_model_config); default: examples/t5_config.py beside --config-dir")
    p.add_argument("--stages", default="0,1,2,3", help="stages to try")
    p.add_argument("--offload", default="both", choices=["both", "no", "only"], help="offload settings to try")
    p.add_argument("--activations", default="recipe", choices=["recipe", "search"],
                   help="search: every setting also with activation checkpointing (+ckpt) and with checkpointing "
                   "+ activation offload (+ckpt+offload); recipe: the experiment's own strategy.activation_* keys")
    p.add_argument("--max-batch", type=int, default=256, help="search ceiling for the micro-batch (--module: max_val)")
    p.add_argument("--bisect-tol", type=float, default=0.0, help="stop bisecting within this fraction")
    p.add_argument("--steps", type=int, default=5, help="timed training steps per candidate")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before timing")
    p.add_argument("--start-method", default=None, choices=["fork", "spawn"], help="default: fork on CPU, spawn on GPU")
    p.add_argument("--json", default=None, metavar="OUT", help="also write all measurements as JSON")
    p.set_defaults(func=_tune)


def _from_deepspeed(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .deepspeed_config import from_deepspeed_config

    overrides, notes = from_deepspeed_config(args.config, world_size=args.world_size).hydra_overrides()
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text("\n".join(overrides) + "\n")
        print(f"wrote {len(overrides)} overrides to {args.out}: python examples/t5_finetune.py $(cat {args.out})",
              file=sys.stderr)
    else:
        print("\n".join(overrides))
    return 0


def _add_from_deepspeed(sub) -> None:
    p = sub.add_parser(
        "from-deepspeed", help="translate a DeepSpeed JSON config into the T5 recipe's Hydra overrides",
        description="Read a DeepSpeed config (zero_optimization, fp16/bf16, gradient_clipping, "
        "gradient_accumulation_steps, micro-batch, optimizer, scheduler) and print the equivalent Hydra "
        "overrides of examples/t5_finetune.py, one per line; keys with no effect here and settings the recipe "
        "cannot take go to stderr as notes; unsupported settings, and those the run would refuse, are refused "
        "(nvme_path is the training machine's: checked when the run starts). From Python: "
        "lightning_zero.from_deepspeed_config(path).make_strategy().")
    p.add_argument("config", help="DeepSpeed JSON config file")
    p.add_argument("--world-size", type=int, default=None, help="the run's ranks: DeepSpeed's train_batch_size = "
                   "micro-batch x accumulation x world size checked, and the accumulation or micro-batch derived "
                   "(required when the config leaves one of them to the world size)")
    p.add_argument("--out", default=None, help="write the overrides to this file instead of stdout")
    p.set_defaults(func=_from_deepspeed)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as err:  # DeepSpeedConfigError and JSON errors are ValueErrors
        print(f"lightning-zero {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
