"""``lightning-zero tune``: its arguments and what it runs (the recipe tuner, ``tuning/tune.py``; with
``--module``, the module tuner, ``tuning/module_tune.py``)."""

from __future__ import annotations

import argparse


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


def add_tune(sub) -> None:
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
