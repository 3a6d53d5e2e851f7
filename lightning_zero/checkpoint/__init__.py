"""Sharded checkpoint directories (torch.distributed.checkpoint) and their consolidation. No Lightning.

``format.py`` writes the directories (``load_dir.py`` reads them back), ``files.py`` finds and checks
what is in them (``names.py``: the names), ``consolidate.py``
turns one into a single fp32 state dict without a process group. The names of ``format.py`` are this
package's API (``from lightning_zero import checkpoint as ck; ck.save_engine_checkpoint(...)``).
"""

from .format import *  # noqa: F401,F403
from .format import _IMPL_KEYS, _OLD, _TMP, _dcp_load, _remove  # noqa: F401  (used by the Lightning hooks, tests)
