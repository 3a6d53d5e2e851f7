"""What ZeroPipelineStrategy's checkpoint hooks do (through its model side, pipeline_side.py): the pipeline's
checkpoint directory with Lightning's metadata.

Design note
-----------
``trainer.save_checkpoint(X)`` is ``save_pipeline_checkpoint`` with Lightning's loops, LR schedulers, callbacks
and precision state as its ``meta.pt`` (checkpoint/pipeline_dir.py: per stage a sharded DCP directory,
written by that stage's data-parallel group; the whole directory renamed into place when complete).
Loading happens after setup, into the stage engines' masters (the fit's pipeline, or the evaluation-only
one of validate / test / predict), resharded to this run's data-parallel size and ZeRO stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from ..checkpoint.files import read_meta, resolve_checkpoint_dir
from ..checkpoint.local_copies import fetch_checkpoint
from ..checkpoint.pipeline_dir import load_pipeline_checkpoint, read_manifest, save_pipeline_checkpoint
from ..checkpoint.trust import trusted

_LOADED_KEY = "lightning_zero_pipeline_dir"


class PipelineCheckpoints:
    """ZeroPipelineStrategy's checkpoint directory: its model side calls this with the pipe to save or load."""

    def __init__(self, trust_checkpoint: bool) -> None:
        self.trust_checkpoint = trust_checkpoint  # the strategy's knob (docs/security.md)
        self._trust = False  # this load's decision: trust_checkpoint, or Lightning's weights_only=False

    @staticmethod
    def save(pipe: Optional[Any], checkpoint: dict[str, Any], path: Path, storage_options: Optional[Any],
             saver=None) -> None:
        """Collective: each stage's group writes its own shards, Lightning's other entries go to ``meta.pt``."""
        if pipe is None:
            raise RuntimeError("save_checkpoint with pipeline_parallel_size needs a fit's pipeline (call it during "
                               "or after trainer.fit).")
        if storage_options is not None:
            raise TypeError("storage_options are not supported for pipeline checkpoints (no CheckpointIO).")
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        save_pipeline_checkpoint(pipe, str(path), meta, saver=saver)  # saver: in the background

    def read(self, checkpoint_path, weights_only: Optional[bool]) -> dict[str, Any]:
        path = resolve_checkpoint_dir(fetch_checkpoint(checkpoint_path, collective=True))  # a URL: a local copy
        read_manifest(path)  # one clear error for anything that is not a pipeline checkpoint
        self._trust = trusted(self.trust_checkpoint, weights_only)
        meta = read_meta(path, trust_checkpoint=self._trust)  # loops, callbacks: restricted unless trusted
        meta["optimizer_states"] = [{}]  # in the stage directories; Lightning checks the key exists
        meta[_LOADED_KEY] = str(path)
        return meta

    def load(self, pipe, checkpoint: Mapping[str, Any]) -> None:
        """Model and optimizer state into ``pipe``'s stage engines, resharded to any data-parallel size."""
        load_pipeline_checkpoint(pipe, checkpoint[_LOADED_KEY], trust_checkpoint=self._trust)
