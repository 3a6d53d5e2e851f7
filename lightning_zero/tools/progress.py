"""A byte progress bar (tqdm, which Lightning depends on) for the commands that read checkpoints: MB/s on
stderr, silent with ``--quiet`` or when nothing is read."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator, Optional


@contextlib.contextmanager
def byte_progress(total: int, desc: str, quiet: bool = False) -> Iterator[Optional[Callable[[int], None]]]:
    """Yields ``update(nbytes)`` for the readers' ``progress=`` argument (None when quiet)."""
    if quiet:
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
              dynamic_ncols=True, mininterval=0.2) as bar:
        yield bar.update
