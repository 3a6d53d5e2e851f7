"""The checkpoint hooks of ZeroPipelineStrategy: per-stage files plus Lightning's metadata, one directory.

Design note
-----------
``trainer.save_checkpoint(X)`` writes :meth:`PipelineZero.save`'s per-stage files (full fp32 values, so any
data-parallel size resumes; engine/pipeline_checkpoint.py) and Lightning's ``meta.pt`` (loops, LR
schedulers, callbacks, precision) into ``X.zero-tmp``, renamed into place as the DCP directories are
(checkpoint/files.py): a name that exists is complete. Loading happens after setup, into the stage engines'
masters (the fit's pipeline, or the evaluation-only one of validate / test / predict).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from ..checkpoint.files import _OLD, _TMP, INFO_FILE, META_FILE, _remove, resolve_checkpoint_dir, tidy_checkpoint_dir

PIPELINE_FORMAT = "lightning_zero.pipeline"
_LOADED_KEY = "lightning_zero_pipeline_dir"


class PipelineCheckpointMixin:
    """Checkpoint hooks for a strategy holding ``pipe`` (the fit's PipelineZero) and ``_forward_pipe``."""

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the stage files hold the weights

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # ... and the optimizer state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        if self.pipe is None:
            raise RuntimeError("save_checkpoint with pipeline_parallel_size needs a fit's pipeline (call it during "
                               "or after trainer.fit).")
        if storage_options is not None:
            raise TypeError("storage_options are not supported for pipeline checkpoints (no CheckpointIO).")
        path = Path(self.broadcast(str(filepath)))
        tmp, old = path.with_name(path.name + _TMP), path.with_name(path.name + _OLD)
        if self.is_global_zero:
            tidy_checkpoint_dir(path.parent)
            tmp.mkdir(parents=True)
        self.barrier()
        self.pipe.save(str(tmp))  # collective; each stage's data-parallel rank 0 writes stage<i>.pt
        if self.is_global_zero:
            meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            torch.save(meta, tmp / META_FILE)
            info = {"format": PIPELINE_FORMAT, "version": 1, "num_stages": self.pipeline_parallel_size,
                    "zero_stage": self.stage}
            (tmp / INFO_FILE).write_text(json.dumps(info, indent=1))
        self.barrier()
        if self.is_global_zero:  # a name that exists is complete (see checkpoint/format.py)
            if os.path.lexists(path):
                _remove(old)
                os.rename(path, old)
            os.rename(tmp, path)
            _remove(old)
        self.barrier()

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # into the stage engines' masters, which exist after setup

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = resolve_checkpoint_dir(self.broadcast(str(checkpoint_path)))
        info_file = path / INFO_FILE
        info = json.loads(info_file.read_text()) if info_file.is_file() else {}
        if info.get("format") != PIPELINE_FORMAT:
            raise ValueError(f"{str(path)!r} is not a pipeline checkpoint directory (no {INFO_FILE} with format "
                             f"{PIPELINE_FORMAT!r}). Allowed: a directory that trainer.save_checkpoint wrote with "
                             f"pipeline_parallel_size.")
        meta = torch.load(path / META_FILE, weights_only=False)
        meta["optimizer_states"] = [{}]  # in the stage files; Lightning checks the key exists
        meta[_LOADED_KEY] = str(path)
        return meta

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._stale = False
        self._forward_pipe.load(checkpoint[_LOADED_KEY])  # model and optimizer state, any data-parallel size

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded with the model above
