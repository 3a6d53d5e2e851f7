"""Sharded checkpoint directories (torch.distributed.checkpoint) and their consolidation. No Lightning.

``format.py`` writes and reads the directories, ``files.py`` names what is in them, ``consolidate.py``
turns one into a single fp32 state dict without a process group. The names of ``format.py`` are this
package's API (``from lightning_zero import checkpoint as ck; ck.save_engine_checkpoint(...)``).
"""

from .format import *  # noqa: F401,F403
from .format import _IMPL_KEYS, _OLD, _TMP, _dcp_load, _remove  # noqa: F401  (used by the Lightning hooks, tests)
