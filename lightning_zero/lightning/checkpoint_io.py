"""ZeroCheckpointIO: the other strategies (DDP, single device; Trainer and Fabric) reading lightning_zero
checkpoint directories, through Lightning's public ``CheckpointIO`` plugin seam.

``Trainer(strategy="ddp", plugins=[ZeroCheckpointIO()]).fit(model, ckpt_path=DIR)`` resumes a ZeRO run under
plain DDP: the directory is consolidated on the fly (lightning_io.py ``load_as_lightning_checkpoint``: full
fp32 weights, the optimizer state keyed by position as a plain optimizer saves it), each rank reading the
whole directory without a collective, as it would read a file. Every other path is read by Lightning's own
``TorchCheckpointIO``, which this class is; saving is Lightning's. ZeroStrategy needs none of this: it reads
its directories itself.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from ..checkpoint.format import INFO_FILE
from ..checkpoint.local_copies import local_checkpoint_copy
from .lightning_io import is_zero_checkpoint, load_as_lightning_checkpoint


class ZeroCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` that also loads lightning_zero checkpoint directories.

    ``trust_checkpoint``: read their pickles unrestricted (docs/security.md); ``weights_only=False`` on one
    load does the same for that load."""

    def __init__(self, trust_checkpoint: bool = False) -> None:
        if not isinstance(trust_checkpoint, bool):
            raise ValueError(f"trust_checkpoint must be True or False; got {trust_checkpoint!r}.")
        self.trust_checkpoint = trust_checkpoint

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if isinstance(path, (str, os.PathLike)) and is_zero_checkpoint(path):
            with local_checkpoint_copy(path) as local:  # a URL: each rank its own copy, as it reads a file
                return load_as_lightning_checkpoint(local, weights_only, map_location=map_location,
                                                    trust_checkpoint=self.trust_checkpoint)
        if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
            raise IsADirectoryError(f"{os.fspath(path)!r} is a directory but not a complete lightning_zero checkpoint "
                                    f"({INFO_FILE} is missing). Allowed: a lightning_zero checkpoint directory or a "
                                    f"checkpoint file.")
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
