"""Autotuning: the benchmark harness (shared with bench/), the stage x offload x micro-batch search of the
recipe, and the per-preset micro-batch of any LightningModule (``module_tune``)."""

from .module_tune import ModuleTuneResult, tune_module
from .tune import Candidate, TuneResult, tune

__all__ = ["Candidate", "ModuleTuneResult", "TuneResult", "tune", "tune_module"]
