"""DeepSpeed as an optional peer: its ZeRO 1/2/3 and CPU-offload engines on the bench model, over gloo on CPU.

Design note
-----------
DeepSpeed is what our users come from, so the peer table puts it beside us when it is installed
(``pip install -e ".[bench]"``; ops are JIT-built with g++ on first use and cached). It is never a
dependency of the package: without it, the ``ds_*`` methods are left out of the defaults and asking
for one names the install command.

* ``ds_zero1`` / ``ds_zero2`` / ``ds_zero3``: ``deepspeed.initialize(model, optimizer=AdamW(...))``
  with ``zero_optimization.stage`` 1/2/3 -- the user's torch AdamW, as our engine keeps it.
* ``ds_zero2_offload`` / ``ds_zero3_offload``: ``offload_optimizer`` (and ``offload_param`` for stage 3)
  to CPU; DeepSpeed then requires its own ``DeepSpeedCPUAdam`` (config ``optimizer`` block), the
  counterpart of our swap to torch's fused CPU AdamW.
* ZeRO-Infinity (``build_infinity``, for bench/nvme_offload.py): stage 3 with the optimizer and the
  parameters offloaded to NVMe through DeepSpeed's ``async_io`` op (libaio, O_DIRECT); one rank.
* DeepSpeed's own API drives the step: ``engine(x)``, ``engine.backward(loss)``, ``engine.step()``.
* Model-state bytes: DeepSpeed keeps its flat buffers in its own objects, so they are counted by
  walking the engine (module, optimizer, their DeepSpeed-owned attributes, the ``ds_tensor`` shards
  and ``.grad`` of parameters) and summing each distinct storage once -- bucket buffers included,
  as they are real memory. Ours are counted by ``engine.memory_report()``; the two agree on what a
  model state is (params, grads, masters, optimizer state) but DeepSpeed's walk also sees its
  preallocated reduce buckets, so its number is an upper bound of the same quantity.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Callable, Optional

import torch
from torch import nn

from lightning_zero.tools.tuning.harness import Runner

DS_METHODS = ("ds_zero1", "ds_zero2", "ds_zero3", "ds_zero2_offload", "ds_zero3_offload")
INSTALL_HINT = 'pip install -e ".[bench]"  (DeepSpeed; its CPU ops are JIT-built with g++ on first use)'

# DeepSpeed picks its accelerator at import time; on a machine without CUDA it must be told "cpu".
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def _owned(obj) -> bool:
    """Objects whose attributes may hold model states: DeepSpeed's own classes, modules and optimizers."""
    mod = type(obj).__module__ or ""
    return mod.startswith("deepspeed") or isinstance(obj, (nn.Module, torch.optim.Optimizer))


def reachable_tensor_bytes(root) -> int:
    """Bytes of the distinct storages of every tensor reachable from ``root`` through owned objects."""
    seen_obj: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_obj:
            continue
        seen_obj.add(id(obj))
        if torch.is_tensor(obj):
            st = obj.untyped_storage()
            if st.nbytes():
                storages[st.data_ptr()] = st.nbytes()
            stack.extend(v for v in (getattr(obj, "grad", None), getattr(obj, "ds_tensor", None)) if v is not None)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif _owned(obj):  # a module's vars hold its _parameters, _buffers and _modules
            stack.extend(vars(obj).values())
    return sum(storages.values())


class DeepSpeedRunner(Runner):
    """A DeepSpeed engine on one rank, stepped through DeepSpeed's own API."""

    def pre(self) -> None:  # DeepSpeed broadcasts nothing per step (buffers are not synchronized)
        pass

    def backward(self, loss: torch.Tensor) -> None:
        self.module.backward(loss)

    def step(self) -> None:
        self.module.step()  # also zeroes the gradients

    def zero_grad(self) -> None:
        self.module.zero_grad()

    def state_bytes(self, finalize: bool = True) -> dict:
        """Everything reachable from the engine; ``host`` = what an offloaded run keeps in CPU memory."""
        total = reachable_tensor_bytes(self.module)
        host = 0
        if self.method.endswith("_offload"):  # fp32 partitions + optimizer state (+ stage 3 param shards)
            opt = self.opt
            roots = [getattr(opt, "single_partition_of_fp32_groups", None),  # stages 1-2
                     getattr(opt, "fp32_partitioned_groups_flat", None),  # stage 3
                     getattr(getattr(opt, "optimizer", None), "state", None)]
            if self.method.startswith("ds_zero3"):
                roots += [p.ds_tensor for p in self.model.parameters() if hasattr(p, "ds_tensor")]
            host = reachable_tensor_bytes([r for r in roots if r is not None])
        return {"params": 0, "grads": 0, "grad_shards": 0, "master": 0, "optimizer_state": 0, "host": host,
                "model_states": total}

    def close(self) -> None:
        self.module.destroy()


def build_deepspeed(method: str, args, make_model: Callable[[object], nn.Module],
                    compute_dtype: Optional[torch.dtype] = None) -> DeepSpeedRunner:
    """``method`` from :data:`DS_METHODS`; the model and AdamW hyper-parameters match ``harness.build``.

    ``compute_dtype=torch.bfloat16`` turns on DeepSpeed's bf16 mode (bf16 params, fp32 master partitions).
    """
    if method not in DS_METHODS:
        raise ValueError(f"unknown DeepSpeed method {method!r}; allowed: {', '.join(DS_METHODS)}")
    if not available():
        raise RuntimeError(f"{method} needs DeepSpeed, which is not installed: {INSTALL_HINT}")
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    stage = int(method[len("ds_zero")])
    offload = method.endswith("_offload")
    torch.manual_seed(args.seed)
    model = make_model(args)
    numel = sum(p.numel() for p in model.parameters())
    # DeepSpeed counts bucket sizes in elements and preallocates some buckets whole: cap them at the model
    bucket = min(int(getattr(args, "bucket_mb", 25.0) * 2**20 / 4), numel)
    zero = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if stage == 3:
        # partition every parameter, as our stage 3 and FSDP2 do (DeepSpeed keeps params < 1e5 whole by default)
        zero.update(stage3_prefetch_bucket_size=bucket, stage3_param_persistence_threshold=0)
    adamw = {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.01}
    config = {"train_micro_batch_size_per_gpu": getattr(args, "batch", 1), "gradient_accumulation_steps": 1,
              "zero_optimization": zero, "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}
    if compute_dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    elif compute_dtype is not None:
        raise ValueError(f"DeepSpeed peer: compute_dtype {compute_dtype} not offered (None or torch.bfloat16)")
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        config["optimizer"] = {"type": "AdamW", "params": adamw}
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        engine, opt, _, _ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), **adamw), config=config)
    runner = DeepSpeedRunner(method, model, engine, opt)
    runner.numel = numel  # counted before stage 3 partitioned the params
    return runner


def cpu_adam(params, **kw) -> torch.optim.Optimizer:
    """DeepSpeed's CPU Adam (AdamW mode) over ``params``, for the kernel table of bench/cpu_optimizer.py."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, adamw_mode=True, **kw)


def infinity_missing() -> Optional[str]:
    """Why DeepSpeed's ZeRO-Infinity (NVMe offload) cannot run here, or None when it can."""
    if not available():
        return f"DeepSpeed is not installed ({INSTALL_HINT})"
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        return ("DeepSpeed's async_io op cannot be built: it needs libaio's headers and .so "
                "(apt install libaio-dev) and g++")
    return None


def build_infinity(make_model: Callable[[], nn.Module], nvme_path: str, batch: int, unit_numel: int,
                   lr: float, weight_decay: float = 0.01) -> tuple[nn.Module, dict]:
    """DeepSpeed ZeRO-3 with ``offload_optimizer`` and ``offload_param`` on NVMe (ZeRO-Infinity), one rank.

    ``make_model`` runs under ``deepspeed.zero.Init`` (NVMe parameter offload partitions at construction;
    it also fixes the fp32 dtype, which DeepSpeed's CPU accelerator would otherwise take as bf16).
    ``unit_numel``: the largest parameter, the size of a parameter swap buffer. Prefetch and live-parameter
    limits keep about one unit ahead, as our ``prefetch=1`` does; ``stage3_max_reuse_distance=0`` releases
    a parameter after use (otherwise it holds a swap buffer until reuse and the 16 run out). The ``aio``
    block is DeepSpeed's default. Returns (engine, config).
    """
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    pin = torch.cuda.is_available()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 2 * unit_numel, "stage3_max_live_parameters": 4 * unit_numel,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": pin, "buffer_count": 4},
            "offload_param": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": pin, "buffer_count": 16,
                              "buffer_size": unit_numel, "max_in_cpu": 0}}
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
              "zero_optimization": zero, "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False,
              "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                      "overlap_events": True},
              "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                        "weight_decay": weight_decay}}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, config
