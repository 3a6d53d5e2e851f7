"""1-bit Adam and 0/1 Adam: momentum (or gradients) exchanged as signs packed 8 per byte with fp32 scales,
the compression error of every worker and of every chunk's server carried to the next exchange.

``compress``: the kernels (sign packing, scales, error feedback); ``exchange``: the error-compensated
compressed all-reduce on torch.distributed collectives and its single-process reference; ``adam`` /
``zoadam``: the optimizers. See docs/onebit_adam.md.
"""


from .adam import OneBitAdam
from .base import CompressedAdamBase
from .zoadam import ZeroOneAdam
from . import kind as _kind  # noqa: F401  the family's optimizer kind, registered on import (kind.py)

__all__ = ["CompressedAdamBase", "OneBitAdam", "ZeroOneAdam"]
