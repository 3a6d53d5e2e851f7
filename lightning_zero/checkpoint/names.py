"""The names in a checkpoint directory: its formats (the ``format`` of ``zero_checkpoint.json``) and its
files. Below every other checkpoint module, so the directory's reader (``files.py``), its seal
(``integrity.py``) and the restricted unpickler (``trust.py``) share them without importing each other."""

FORMAT, VERSION = "lightning_zero.dcp", 1
MODELS_FORMAT = "lightning_zero.models"  # several models' directories in one (models_dir.py)
PIPELINE_FORMAT = "lightning_zero.pipeline"  # pipeline_dir.py's manifest
INFO_FILE, META_FILE, DCP_METADATA = "zero_checkpoint.json", "meta.pt", ".metadata"  # DCP's own metadata file


def optim_key(index: int) -> str:
    """The DCP key of optimizer ``index``'s state ("optim", "optim_1", ...)."""
    return "optim" if index == 0 else f"optim_{index}"


# [Note: trainable-only checkpoints] (trainable_only.py): the json's entry of the base reference; such a json
# is version 2, which builds reading only version 1 refuse (a full checkpoint stays version 1)
TRAINABLE_ONLY, TRAINABLE_ONLY_VERSION = "trainable_only", 2
