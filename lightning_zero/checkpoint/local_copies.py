"""Local copies of checkpoints at fsspec URLs (the load side of ``location.py``): one download per host into
the staging directory, handed to the unchanged readers, removed when done; and the command line's outputs at
a URL, written locally and uploaded when complete ([Note: checkpoints at fsspec locations])."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import socket
import tempfile
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch.distributed as dist

from .location import _agree, _aside, _attempt, _complete, _files, _fs, _join, _multi, as_url, staging_root
from .names import INFO_FILE

_log = logging.getLogger(__name__)
_PathLike = Union[str, os.PathLike]


# -- load ----------------------------------------------------------------------------------------------------------
def remote_source(path: _PathLike) -> Optional[str]:
    """Where the complete copy of the remote ``X`` is (``X``, or ``X.zero-old`` after an interrupted save), as a
    path of its filesystem; None when neither is complete."""
    fs, root = _fs(as_url(path))
    if _complete(fs, root):
        return root
    return _aside(root) if _complete(fs, _aside(root)) else None


def is_remote_checkpoint(path: _PathLike) -> bool:
    return remote_source(path) is not None


_FETCHED: list[Path] = []  # this process's downloads still in use
_AT_EXIT = False


@contextlib.contextmanager
def local_checkpoint_copy(path: _PathLike, collective: bool = False, group=None) -> Iterator[Any]:
    """``path`` itself when local; for a URL a local copy of the checkpoint directory, removed on exit.
    ``collective``: every rank of ``group`` (default: the world) calls it, and one rank per host downloads."""
    if as_url(path) is None:
        yield path
        return
    local, mine = _download(path, collective, group, before=_release_fetched)
    try:
        yield local
    except BaseException as err:
        err.add_note(f"(read from a local copy of {as_url(path)!r})")
        if mine and collective and _multi(group):  # no collective here: the others on this host may still read
            _remove_at_exit(local)
        elif mine:
            shutil.rmtree(local.parent, ignore_errors=True)
        raise
    if collective and _multi(group):
        dist.barrier(group=group)  # the others on this host read the same copy
    if mine:
        shutil.rmtree(local.parent, ignore_errors=True)


def fetch_checkpoint(path: _PathLike, collective: bool = False, group=None) -> Any:
    """:func:`local_checkpoint_copy` for a caller that reads later (the Trainer reads it in several hooks): the
    local copy (of a directory, or of a single-file checkpoint) is kept until the next fetch (every rank has
    finished reading it by then: a new restore started) or process exit. A local path is returned unchanged."""
    if as_url(path) is None:
        return path
    local, mine = _download(path, collective, group, before=_release_fetched)
    if mine:
        _remove_at_exit(local)
    return local


def _download(path: _PathLike, collective: bool, group, before=lambda: None) -> tuple[Path, bool]:
    """(the local copy, whether this rank made it and removes it); ``before`` runs once every rank is here."""
    url = as_url(path)
    fs, root = _fs(url)
    src = root if fs.isfile(root) else _resolve(fs, root, url)  # a single-file checkpoint: that file
    host = f"{socket.gethostname()}:{staging_root()}"
    every = [(host, uuid.uuid4().hex)]
    me = 0
    if collective and _multi(group):
        me = dist.get_rank(group)
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, (host, uuid.uuid4().hex), group=group)
    before()
    leader = min(r for r, (h, _) in enumerate(every) if h == host)  # the first rank on this host downloads
    local = staging_root() / f"lightning_zero-load-{every[leader][1]}" / src.rstrip("/").rpartition("/")[2]
    err = _attempt(lambda: _get_tree(fs, src, local)) if me == leader else None
    if err is not None:
        shutil.rmtree(local.parent, ignore_errors=True)
    if collective:
        _agree(group, err, "downloading", url)
    elif err is not None:
        raise err
    if me == leader:
        _log.debug("Checkpoint %s read from its local copy %s", url, local)
    return local, me == leader


def _resolve(fs, root: str, url: str) -> str:
    if _complete(fs, root):
        return root
    old = _aside(root)
    if _complete(fs, old):
        warnings.warn(f"Checkpoint {url!r} is incomplete or missing: a save was interrupted while replacing it. "
                      f"Loading the previous, complete checkpoint {old!r} instead.", stacklevel=4)
        return old
    if not fs.exists(root):
        raise FileNotFoundError(f"Checkpoint directory not found: {url!r}.")
    raise ValueError(f"{url!r} is not a complete lightning_zero checkpoint: {INFO_FILE} is missing (an "
                     "interrupted save, or not a checkpoint written by ZeroStrategy).")


def _get_tree(fs, src: str, local: Path) -> None:
    if fs.isfile(src):
        local.parent.mkdir(parents=True, exist_ok=True)
        return fs.get_file(src, str(local))
    for rel in _files(fs, src):
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(_join(src, rel), str(local / rel))


def _release_fetched() -> None:
    while _FETCHED:
        shutil.rmtree(_FETCHED.pop().parent, ignore_errors=True)


def _remove_at_exit(local: Path) -> None:
    global _AT_EXIT
    if not _AT_EXIT:
        _AT_EXIT = bool(atexit.register(_release_fetched))
    _FETCHED.append(local)


# -- single outputs (the command line's consolidated file, an exported directory) ------------------------------
@contextlib.contextmanager
def local_output(path: _PathLike) -> Iterator[Any]:
    """``path`` when local; for a URL a local path of the same name, uploaded on a clean exit (a file through a
    temporary name, a directory with its ``config.json`` last, what ``from_pretrained`` opens first)."""
    url = as_url(path)
    if url is None:
        yield path
        return
    fs, root = _fs(url)
    tmp = Path(tempfile.mkdtemp(prefix="lightning_zero-out-", dir=staging_root()))
    local = tmp / root.rstrip("/").rpartition("/")[2]
    try:
        yield local
        if local.is_dir():
            rels = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
            for rel in [r for r in rels if r != "config.json"] + [r for r in rels if r == "config.json"]:
                fs.makedirs(_join(root, rel).rpartition("/")[0], exist_ok=True)
                fs.put_file(str(local / rel), _join(root, rel))
        else:
            fs.makedirs(root.rpartition("/")[0], exist_ok=True)
            fs.put_file(str(local), root + ".zero-tmp")
            fs.mv(root + ".zero-tmp", root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
