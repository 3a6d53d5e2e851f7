"""Lightning's fork/spawn launcher for ZeroPipelineStrategy: the main process learns its module was trained elsewhere."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.trainer.states import TrainerFn

from .compat import MultiProcessingLauncher

TRAINED_ELSEWHERE = "_lightning_zero_pipeline_trained_elsewhere"


class PipelineLauncher(MultiProcessingLauncher):
    """Lightning's fork/spawn launcher, which also marks the main process's module after a fit.

    The launcher hands rank 0's module state back to the main process, but under pipeline parallelism rank 0
    holds stage 0 only, and the main process's module (whose stages ``configure_model`` built in the workers)
    none: a later ``trainer.validate(model)`` would silently evaluate freshly built stages. The mark makes
    that one clear error instead (unless a ``ckpt_path`` loads the trained weights)."""

    def get_extra_results(self, trainer) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        extra[TRAINED_ELSEWHERE] = trainer.state.fn == TrainerFn.FITTING
        return extra

    def update_main_process_results(self, trainer, extra: dict[str, Any]) -> None:
        if extra.pop(TRAINED_ELSEWHERE, False):
            setattr(trainer.lightning_module, TRAINED_ELSEWHERE, True)
        super().update_main_process_results(trainer, extra)
