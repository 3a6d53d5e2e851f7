"""ZeroBatchSizeFinder: Lightning's batch-size search, under ZeroStrategy, against a memory cap.

Design note
-----------
Lightning's ``BatchSizeFinder`` and ``Tuner.scale_batch_size`` refuse every distributed strategy (ZeroStrategy
is a DDPStrategy, so also at devices=1), and on CPU they have no out-of-memory error to probe with. This
callback keeps Lightning's flow -- at fit start a checkpoint is saved, the fit loop runs ``steps_per_trial``
real training steps per candidate with the loggers and other callbacks set aside, and afterwards the
checkpoint (weights, optimizer and scheduler state, loops) is restored and removed, so the fit that follows
starts from the state it would have had -- and replaces two things:

* **fits**: the peak of a trial's steps against ``max_bytes``. CPU: the rule of
  ``engine/memory/step_bytes.py`` (the engine's device model states + saved activations + the state the
  step creates); GPU: ``torch.cuda.max_memory_allocated`` against ``max_bytes`` or the device's memory.
* **agreement**: every rank measures, the peaks are all-reduced (max) before a decision, so all ranks
  take the same -- the smallest fitting -- answer and keep their collectives in step.

The search is Lightning's: doubling from ``init_val`` ("power" stops at the first failure, "binsearch"
then bisects between the last fit and the first failure), at most ``max_trials`` trials, capped by
``max_val`` and the dataset length; the batch size attribute is found and set with Lightning's
``lightning_hasattr`` / ``lightning_setattr`` (``model.batch_size``, ``model.hparams.batch_size``, the
datamodule's). A real out-of-memory error on one rank of several cannot be agreed on (the other ranks
wait in a collective), so it is raised with a hint to cap ``max_bytes`` below the device memory.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.utilities.memory import garbage_collection_cuda, is_oom_error
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from .callback_checks import lightning_finder_refusal
from .compat import (TunerExitException, batch_size_scaling, fit_data_is_module, fit_dataset_length,
                     restore_checkpoint, tuning_module)
from ..engine.memory.step_bytes import StepMeter, engine_memory, step_device_bytes
from ..engine.placement.placement import Location

log = logging.getLogger(__name__)

# Lightning's finder's own loop handling (module-level names: getattr keeps them out of name mangling;
# compat checked they exist)
_lightning_scaling = batch_size_scaling()
_dump_params = getattr(_lightning_scaling, "__scale_batch_dump_params")
_reset_params = getattr(_lightning_scaling, "__scale_batch_reset_params")
_restore_params = getattr(_lightning_scaling, "__scale_batch_restore_params")
_reset_dataloaders = _lightning_scaling._reset_dataloaders
_reset_progress = _lightning_scaling._reset_progress
_try_loop_run = _lightning_scaling._try_loop_run



class _TrialMeter(Callback):
    """The only callback during a trial: the peak step bytes on this rank (CPU rule, or the CUDA peak)."""

    def __init__(self, strategy) -> None:
        self.strategy = strategy
        self.gpu = strategy.root_device.type == "cuda"
        self.peak = 0
        self._meter: Optional[StepMeter] = None
        self._after_backward: Optional[tuple[dict, int]] = None

    def start(self) -> None:
        self.peak = 0
        if self.gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def stop(self) -> int:
        self._close()
        if self.gpu:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        return self.peak

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.gpu:
            self._close()
            self._meter = StepMeter(pl_module.parameters())
            self._meter.start_forward()

    def _close(self) -> None:
        if self._meter is not None:
            self._meter.close()
        self._meter, self._after_backward = None, None

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._meter is not None:
            self._meter.stop_forward()
            self._meter.start_backward()

    def on_after_backward(self, trainer, pl_module) -> None:
        if self._meter is not None:
            self._meter.stop_backward()
            self._after_backward = (engine_memory(self.strategy.engine), self._meter.activations)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._after_backward is not None:  # None: the step was skipped (training_step returned None)
            mem, act = self._after_backward
            engine = self.strategy.engine
            state = max(0, engine.memory_report().optimizer_state - mem["optimizer_state"])
            # the state the first step creates counts where the placement keeps it ([Note: placement])
            created = int(engine.plan.placement.book(optimizer_states=state)[Location.DEVICE])
            self.peak = max(self.peak, step_device_bytes(mem, act, created))
        self._close()


class ZeroBatchSizeFinder(Callback):
    """The largest micro-batch whose training steps fit ``max_bytes`` per rank, found at fit start.

    Args mirror Lightning's ``BatchSizeFinder``; ``max_bytes``: the cap per rank (required on CPU; on a GPU
    default: the device's memory). ``margin``: a fraction taken off the answer (Lightning's binsearch takes
    0.05 off a point where it ran out of memory; the cap here is already the stated limit, so 0).
    After the search the module's (or datamodule's) ``batch_arg_name`` holds the answer, also in
    :attr:`optimal_batch_size`; :attr:`trials` lists ``(batch_size, fits, peak_bytes)`` with the max over ranks.
    """

    SUPPORTED_MODES = ("power", "binsearch")

    def __init__(self, max_bytes: Optional[int] = None, mode: str = "binsearch", steps_per_trial: int = 3,
                 init_val: int = 2, max_trials: int = 25, batch_arg_name: str = "batch_size",
                 margin: float = 0.0, max_val: int = 8192) -> None:
        mode = str(mode).lower()
        if mode not in self.SUPPORTED_MODES:
            raise ValueError(f"mode={mode!r}: allowed {', '.join(map(repr, self.SUPPORTED_MODES))}.")
        for name, v in (("steps_per_trial", steps_per_trial), ("init_val", init_val), ("max_trials", max_trials),
                        ("max_val", max_val)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r}: allowed a positive int.")
        if max_bytes is not None and (not isinstance(max_bytes, (int, float)) or max_bytes <= 0):
            raise ValueError(f"max_bytes={max_bytes!r}: allowed a positive number of bytes per rank, or None "
                             "(GPU only: the device's memory).")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin={margin!r}: allowed 0 <= margin < 1.")
        self.max_bytes = int(max_bytes) if max_bytes is not None else None
        self._mode, self._steps_per_trial, self._init_val = mode, steps_per_trial, init_val
        self._max_trials, self._batch_arg_name, self._margin, self._max_val = max_trials, batch_arg_name, margin, max_val
        self.optimal_batch_size: Optional[int] = None
        self.trials: list[tuple[int, bool, int]] = []
        self.cap_bytes: Optional[int] = None
        self._early_exit = False  # as Lightning's Tuner: stop the fit after the search (the CLI)

    # -- checks ---------------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: Optional[str] = None) -> None:
        from .strategy import ZeroStrategy

        strategy = trainer.strategy
        if not isinstance(strategy, ZeroStrategy):
            raise ValueError(f"ZeroBatchSizeFinder measures ZeroStrategy's engine; the strategy is "
                             f"{type(strategy).__name__}. Allowed: a ZeroStrategy (strategy='zero0' ... "
                             "'zero3_offload'); with other strategies use Lightning's BatchSizeFinder.")
        from .pipeline_strategy import ZeroPipelineStrategy

        if isinstance(strategy, ZeroPipelineStrategy):
            raise ValueError("ZeroBatchSizeFinder does not run under pipeline parallelism (one engine per stage "
                             "chunk). Allowed: ZeroStrategy without pipeline_parallel_size.")
        if not fit_data_is_module(trainer):
            raise ValueError("ZeroBatchSizeFinder cannot be used with dataloaders passed directly to `.fit()` (it "
                             "rebuilds them at each batch size). Allowed: train_dataloader() in the LightningModule "
                             "or a LightningDataModule.")
        if not lightning_hasattr(pl_module, self._batch_arg_name):
            raise ValueError(f"Field {self._batch_arg_name!r} not found in the model, the datamodule, nor their "
                             "hparams; the finder sets it. Allowed: batch_arg_name naming one of them.")
        if self.max_bytes is None and strategy.root_device.type != "cuda":
            raise ValueError("ZeroBatchSizeFinder on CPU needs max_bytes (the cap per rank): a CPU has no "
                             "out-of-memory error to probe. Allowed: max_bytes=<bytes>, or a CUDA device.")

    def on_fit_start(self, trainer, pl_module) -> None:
        self.scale_batch_size(trainer, pl_module)

    # -- the search -----------------------------------------------------------------------------------
    def scale_batch_size(self, trainer, pl_module) -> Optional[int]:
        if trainer.fast_dev_run:
            rank_zero_warn("Skipping ZeroBatchSizeFinder since `fast_dev_run` is enabled.")
            return None
        strategy = trainer.strategy
        device = strategy.root_device
        self.cap_bytes = self.max_bytes or torch.cuda.get_device_properties(device).total_memory
        # one path for every rank: the checkpoint is a sharded directory all of them write
        ckpt_path = strategy.broadcast(os.path.join(trainer.default_root_dir,
                                                    f".zero_scale_batch_size_{uuid.uuid4()}.ckpt"))
        trainer.save_checkpoint(ckpt_path)
        params = _dump_params(trainer)
        _reset_params(trainer, self._steps_per_trial)
        meter = _TrialMeter(strategy)
        trainer.callbacks = [meter]  # Lightning's finder runs trials with no callbacks; ours measures
        if trainer.progress_bar_callback:
            trainer.progress_bar_callback.disable()
        found = None
        # each trial's loop run ends with the strategy's on_train_end, which hands the module back (stage 3
        # un-partitions it for good, mixed precision writes the masters into it): that is for the real fit
        reported = strategy._memory_reported
        strategy.on_train_end = lambda: None
        try:
            found = self._search(trainer, pl_module, meter, params)
        finally:
            del strategy.on_train_end
            strategy._memory_reported = reported  # the memory table belongs to the real fit's first step
            if found is not None:
                lightning_setattr(pl_module, self._batch_arg_name, found)  # the restored loaders use it
            _restore_params(trainer, params)
            if trainer.progress_bar_callback:
                trainer.progress_bar_callback.enable()
            restore_checkpoint(trainer, ckpt_path)
            strategy.barrier("zero_batch_size_finder")
            strategy.remove_checkpoint(ckpt_path)
            garbage_collection_cuda()
        self.optimal_batch_size = found
        tried = " ".join(f"{b}{'+' if ok else '-'}" for b, ok, _ in self.trials)
        rank_zero_info(f"ZeroBatchSizeFinder: micro-batch {found} fits {self.cap_bytes / 2**20:.2f} MiB per rank "
                       f"(trials: {tried})")
        if self._early_exit:
            raise TunerExitException()
        return found

    def _search(self, trainer, pl_module, meter: _TrialMeter, params: dict) -> int:
        limit = min(self._max_val, self._dataset_length(trainer))
        size = min(self._init_val, limit)
        low, high = 0, None  # the largest size that fits, the smallest that does not
        for _ in range(self._max_trials):
            lightning_setattr(pl_module, self._batch_arg_name, size)
            _reset_dataloaders(trainer)
            _reset_progress(trainer)
            fits = self._trial(trainer, meter, params, size)
            if fits:
                low = size
                if high is None:
                    if size >= limit:
                        break
                    nxt = min(2 * size, limit)
                elif self._mode == "power" or high - low <= 1:
                    break
                else:
                    nxt = (low + high) // 2
            else:
                high = size
                if low and self._mode == "power":
                    break
                if high - low <= 1:
                    break
                nxt = (low + high) // 2 if low else max(1, size // 2)
            size = nxt
        if not low:
            b, _, peak = self.trials[-1]
            raise ValueError(f"ZeroBatchSizeFinder: nothing fits {self.cap_bytes / 2**20:.2f} MiB per rank: "
                             f"micro-batch {b} needs {peak / 2**20:.2f} MiB ({len(self.trials)} trial(s)). "
                             "Allowed: a larger max_bytes, a stage that shards more (zero3, *_offload), "
                             "activation_checkpointing, or bf16-mixed precision.")
        if self._margin > 0:
            low = max(1, int(low * (1 - self._margin)))
        return low

    def _trial(self, trainer, meter: _TrialMeter, params: dict, size: int) -> bool:
        strategy = trainer.strategy
        multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        oom = 0
        meter.start()
        try:
            _try_loop_run(trainer, params)
        except RuntimeError as err:
            if not is_oom_error(err):
                raise
            if multi:
                raise RuntimeError(f"ZeroBatchSizeFinder: out of memory at micro-batch {size} on rank "
                                   f"{strategy.global_rank}; the other ranks cannot be told. Allowed: a max_bytes "
                                   "below the device memory, so that the cap is reached first.") from err
            oom = 1
            garbage_collection_cuda()
        finally:
            peak = meter.stop()
        flags = torch.tensor([float(peak), float(oom)], dtype=torch.float64, device=strategy.root_device)
        if multi:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        peak, oom = int(flags[0].item()), bool(flags[1].item())
        fits = not oom and peak <= self.cap_bytes
        self.trials.append((size, fits, peak))
        log.debug("ZeroBatchSizeFinder: micro-batch %d peak %d bytes -> %s", size, peak, fits)
        return fits

    @staticmethod
    def _dataset_length(trainer) -> int:
        loop = trainer.fit_loop
        loop.setup_data()
        try:
            return fit_dataset_length(loop)
        except (NotImplementedError, TypeError, AttributeError):  # iterable-style data
            return 2**62


def install() -> None:
    """``Tuner(trainer).scale_batch_size(model)`` checks its strategy before anything runs: there, with a
    ZeroStrategy, the error names ZeroBatchSizeFinder (once; other strategies keep Lightning's check)."""
    tuning = tuning_module()

    original = tuning._check_scale_batch_size_configuration
    if getattr(original, "_lightning_zero", False):
        return

    def check(trainer) -> None:
        from .strategy import ZeroStrategy

        if isinstance(trainer.strategy, ZeroStrategy):
            raise ValueError(lightning_finder_refusal("Lightning's Tuner.scale_batch_size"))
        original(trainer)

    check._lightning_zero = True  # type: ignore[attr-defined]
    tuning._check_scale_batch_size_configuration = check


__all__ = ["ZeroBatchSizeFinder", "install"]
