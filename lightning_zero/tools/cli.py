"""``lightning-zero`` console command. Subcommands: ``consolidate``, ``export``, ``estimate``, ``tune``,
``from-deepspeed`` (the arguments of ``estimate`` and ``tune`` in ``cli_estimate.py`` / ``cli_tune.py``).

    lightning-zero consolidate CKPT_DIR OUT [--dtype fp32|bf16|fp16] [--lightning [--optimizer]] [--quiet]
                               [--adapter | --merged] [--trust-checkpoint]
    lightning-zero export CKPT_DIR OUTDIR --hf|--adapter [--prefix model.] [--config DIR_or_config.json]
                          [--trust-checkpoint]
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

from .cli_estimate import add_estimate
from .cli_tune import add_tune

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
    part = "adapter" if args.adapter else "merged" if args.merged else None
    if part is not None:  # a trainable-only checkpoint's adapter alone, or folded into its base
        if args.lightning:
            raise ValueError(f"--{part} writes a plain state dict; --lightning writes the whole model. Allowed: one.")
        from ..checkpoint.trainable_parts import write_part

        info = write_part(args.ckpt_dir, args.out, part, dtype, trust_checkpoint=args.trust_checkpoint)
        print(f"wrote {info['tensors']} tensors ({info['bytes'] / 2**20:.1f} MiB) to {args.shown_out} ({part})")
        return 0
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
    print(f"wrote {info['tensors']} tensors ({info['bytes'] / 2**20:.1f} MiB) to {args.shown_out}{what}")
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
    print(f"wrote {info['tensors']} tensors ({info['bytes'] / 2**20:.1f} MiB) to {args.shown_out} (pipeline "
          f"checkpoint: every stage's weights under the uncut model's names)")
    return 0


def _at_locations(command, out: str):
    """``command`` reading ``args.ckpt_dir`` and writing ``args.<out>``, either of them an fsspec URL (``s3://``,
    ``file://``, ...): the checkpoint read from a local copy, the output written locally and uploaded when
    complete (checkpoint/local_copies.py); ``args.shown_out`` is what the user named."""
    def run(args: argparse.Namespace) -> int:
        from ..checkpoint.local_copies import local_checkpoint_copy, local_output

        args.shown_out = getattr(args, out)
        with local_checkpoint_copy(args.ckpt_dir) as src, local_output(args.shown_out) as dst:
            args.ckpt_dir = str(src)
            setattr(args, out, str(dst))
            return command(args)

    return run


def _export(args: argparse.Namespace) -> int:
    import torch

    from .export_hf import export_hf

    if not args.hf and not args.adapter:
        raise ValueError("export needs a target format; allowed: --hf (a transformers save_pretrained directory) "
                         "or --adapter (a trainable-only checkpoint's peft adapter directory).")
    res = export_hf(args.ckpt_dir, args.out_dir, prefix=args.prefix, config=args.config,
                    dtype=getattr(torch, _DTYPES[args.dtype]), quiet=args.quiet, trust_checkpoint=args.trust_checkpoint,
                    adapter=args.adapter)
    print(f"wrote {res['tensors']} tensors ({res['bytes'] / 2**20:.1f} MiB) of {res['class']} (prefix "
          f"{res['prefix']!r}) to {args.shown_out}: {res['class']}.from_pretrained({args.shown_out!r})")
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
    _add_parts(p)
    _add_trust(p)
    p.set_defaults(func=_at_locations(_export, "out_dir"))


def _add_parts(p) -> None:
    """A trainable-only checkpoint's forms (checkpoint/trainable_parts.py); without a flag: the whole model."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--adapter", action="store_true", help="trainable-only checkpoint: the trained parameters alone "
                   "(consolidate: under the module's names; export: peft's adapter_model.safetensors + "
                   "adapter_config.json), no base read")
    if p.prog.endswith("consolidate"):
        g.add_argument("--merged", action="store_true", help="trainable-only checkpoint: each LoRA layer folded "
                       "into its base weight (read from the recorded base), under the plain model's names")


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
    _add_parts(p)
    _add_trust(p)
    p.set_defaults(func=_at_locations(_consolidate, "out"))
    _add_export(sub)
    add_estimate(sub)
    add_tune(sub)
    _add_from_deepspeed(sub)
    return parser


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
