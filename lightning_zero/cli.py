"""``lightning-zero`` console command. Subcommands: ``consolidate`` (more, e.g. ``estimate``, can be added).

    lightning-zero consolidate CKPT_DIR OUT [--dtype fp32|bf16|fp16]
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _consolidate(args: argparse.Namespace) -> int:
    import torch

    from .consolidate import consolidate

    info = consolidate(args.ckpt_dir, args.out, dtype=getattr(torch, _DTYPES[args.dtype]))
    print(f"wrote {info['tensors']} tensors ({info['bytes'] / 2**20:.1f} MiB) to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-zero", description="lightning_zero utilities")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "consolidate",
        help="write one full model state dict from a sharded checkpoint directory",
        description="Write the full model state dict of a sharded (DCP) checkpoint directory to OUT: "
        "torch.save, or safetensors when OUT ends with .safetensors. Runs on CPU in one process; the "
        "optimizer state is never read. The result loads into the plain model with strict=True.",
    )
    p.add_argument("ckpt_dir", help="checkpoint directory written by ZeroStrategy / trainer.save_checkpoint")
    p.add_argument("out", help="output file (.pt/.ckpt/.bin: torch.save; .safetensors: safetensors)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32", help="dtype of floating tensors")
    p.set_defaults(func=_consolidate)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as err:
        print(f"lightning-zero {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
