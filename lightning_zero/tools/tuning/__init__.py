"""Autotuning: the benchmark harness (shared with bench/) and the stage x offload x micro-batch search."""

from .tune import Candidate, TuneResult, tune

__all__ = ["Candidate", "TuneResult", "tune"]
