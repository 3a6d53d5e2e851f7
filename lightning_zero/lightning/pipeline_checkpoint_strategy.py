"""The checkpoint hooks of ZeroPipelineStrategy: the pipeline's checkpoint directory with Lightning's metadata.

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
from ..checkpoint.pipeline_dir import load_pipeline_checkpoint, read_manifest, save_pipeline_checkpoint
from ..checkpoint.trust import trusted

_LOADED_KEY = "lightning_zero_pipeline_dir"


class PipelineCheckpointMixin:
    """Checkpoint hooks for a strategy holding ``pipe`` (the fit's PipelineZero) and ``_forward_pipe``."""

    trust_checkpoint = False  # the host's knob (ZeroStrategy's argument; docs/security.md)
    _zero_trust = False  # this load's decision: trust_checkpoint, or Lightning's weights_only=False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the stage directories hold the weights

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # ... and the optimizer state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        if self.pipe is None:
            raise RuntimeError("save_checkpoint with pipeline_parallel_size needs a fit's pipeline (call it during "
                               "or after trainer.fit).")
        if storage_options is not None:
            raise TypeError("storage_options are not supported for pipeline checkpoints (no CheckpointIO).")
        path = Path(self.broadcast(str(filepath)))
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        save_pipeline_checkpoint(self.pipe, str(path), meta)  # collective; each stage's group writes its own shards

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # into the stage engines' masters, which exist after setup

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = resolve_checkpoint_dir(self.broadcast(str(checkpoint_path)))
        read_manifest(path)  # one clear error for anything that is not a pipeline checkpoint
        self._zero_trust = trusted(self.trust_checkpoint, weights_only)
        meta = read_meta(path, trust_checkpoint=self._zero_trust)  # loops, callbacks: restricted unless trusted
        meta["optimizer_states"] = [{}]  # in the stage directories; Lightning checks the key exists
        meta[_LOADED_KEY] = str(path)
        return meta

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._stale = False
        load_pipeline_checkpoint(self._forward_pipe, checkpoint[_LOADED_KEY],  # model + optimizer, any DP size
                                 trust_checkpoint=self._zero_trust)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded with the model above
