"""Checkpoint directories at any fsspec location (``s3://bucket/run1``, ``gs://...``, ``memory://...``,
``file://...``): written through a local staging directory and uploaded; read from a local copy
(``local_copies.py``, the load side).

[Note: checkpoints at fsspec locations]
The writers (DCP, ``meta.pt``, the integrity listing) and the readers (checksums, the restricted unpickling of
``trust.py``) work on local files only, and stay so: a URL is turned into local files at the edges. A save
writes into a per-process staging directory (each rank holds only what it wrote: DCP's ``__<rank>_*`` files;
the first rank ``.metadata``, ``meta.pt`` and ``zero_checkpoint.json``), then uploads it; a load downloads the
directory once per host and hands the local copy to the unchanged readers, so every check that holds locally
holds for a URL (a remote name is confined to the copy, too).

Object stores have no atomic rename of a directory, so the remote commit marker is ``zero_checkpoint.json``:
a remote directory without it is incomplete and never read, and it is written last, by the first rank, only
after an agreement that every rank's upload succeeded (any rank's failure is raised on every rank, no json is
written and the new files are removed). Replacing a complete ``X`` keeps a complete copy findable at every instant:
``X`` is copied to ``X.zero-old`` (:func:`~.files.aside_path`; its json copied last), ``X``'s json deleted
first and then the rest, the new files uploaded, the new json last, then ``X.zero-old`` deleted. A reader
that finds no json in ``X`` falls back to a complete ``X.zero-old`` (as ``files.resolve_checkpoint_dir`` does
locally), and the next save keeps that copy until its own json is written. The replace is done after the
local write succeeded, so a failing write leaves ``X`` untouched. Why not upload into ``X.zero-tmp`` and copy it
into place, as the local save renames: every save would pay a server-side copy of the whole checkpoint, while
copying the previous ``X`` aside costs only when a name is replaced (``last.ckpt``; ModelCheckpoint's top-k
names are new each time). Plain local paths never come here: they keep the atomic renames of ``format.py``.

Loading, the first rank of each host (by hostname and staging directory) downloads and the others wait for
the agreement: N ranks of a node cost one download and one node's disk holds one copy.

``pathlib.Path`` collapses ``//``, so a URL that went through it (``Path("s3://b/k")`` is ``s3:/b/k``) is
recognized too, for a protocol fsspec knows (a drive letter is one letter, never a protocol).

Staging and download space is local: ``LIGHTNING_ZERO_STAGING_DIR`` (default: the system temp directory)
needs room for this rank's share of one checkpoint while saving, and for one whole checkpoint per host
while loading. Downloads are removed when the load is done, at the latest at process exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path, PurePosixPath
from typing import Any, Iterator, Optional, Union

import torch.distributed as dist

from .files import aside_path
from .names import INFO_FILE

_log = logging.getLogger(__name__)
_PathLike = Union[str, os.PathLike]
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):(/*)(.*)$", re.S)
STAGING_ENV = "LIGHTNING_ZERO_STAGING_DIR"


# -- what is a URL ---------------------------------------------------------------------------------------------
def as_url(path: Any) -> Optional[str]:
    """The fsspec URL ``path`` names (also after ``pathlib`` collapsed its ``//``); None for a local path."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    s = os.fspath(path)
    if not isinstance(s, str):
        return None
    m = _URL.match(s)  # a chained URL ("simplecache::s3://...") is named by its first protocol
    if m is None or len(m.group(1)) < 2 or m.group(1).lower() not in _protocols():
        return None
    proto, slashes, rest = m.groups()
    if "::" in s or slashes.startswith("//"):
        return s
    if slashes != "/":
        return None  # "name:rest": a local file name with a colon
    return f"{proto}://{'/' if _rooted(proto) else ''}{rest}"


def _rooted(proto: str) -> bool:
    """Whether the protocol's paths start at "/" (local files, memory) rather than at a bucket."""
    import fsspec

    try:
        return getattr(fsspec.get_filesystem_class(proto), "root_marker", "") == "/"
    except ImportError:  # its package is not installed: opening the URL says which one to install
        return False


def is_remote(path: Any) -> bool:
    """A URL with a protocol fsspec knows (``memory://``, ``file://``, ``s3://``, ...); plain paths are local."""
    return as_url(path) is not None


def _protocols() -> frozenset:
    import fsspec

    # fsspec's known names and those registered at run time (a plugin's register_implementation)
    return frozenset(p.lower() for p in [*fsspec.available_protocols(), *fsspec.registry])


def _fs(url: str):
    from fsspec.core import url_to_fs

    return url_to_fs(url)


def _join(root: str, rel: str) -> str:
    return root.rstrip("/") + "/" + rel


def _aside(root: str) -> str:
    parent, _, name = root.rstrip("/").rpartition("/")
    return (parent + "/" if parent or root.startswith("/") else "") + aside_path(name).name


def staging_root() -> Path:
    root = Path(os.environ.get(STAGING_ENV) or tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    return root


# -- remote trees -------------------------------------------------------------------------------------------------
def _complete(fs, root: str) -> bool:
    return fs.isfile(_join(root, INFO_FILE))


def _files(fs, root: str) -> list[str]:
    """Every file under ``root``, relative to it, each confined to it (a hostile listing names no '..')."""
    root_s = root.rstrip("/")
    out = []
    for f in fs.find(root_s, detail=False):
        rel = f[len(root_s):].lstrip("/") if f.startswith(root_s) else None
        parts = PurePosixPath(rel).parts if rel else ()
        if not parts or ".." in parts or rel.startswith("/"):
            raise ValueError(f"Remote checkpoint {root!r} lists {f!r}, outside the directory; nothing was read.")
        out.append(rel)
    return sorted(out)


def _commit_last(rels: list[str]) -> list[str]:
    return [r for r in rels if r != INFO_FILE] + [r for r in rels if r == INFO_FILE]


def _remove_tree(fs, root: str) -> None:
    """The json first: a directory being removed is never one a reader takes for complete."""
    if _complete(fs, root):
        fs.rm_file(_join(root, INFO_FILE))
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _copy_tree(fs, src: str, dst: str) -> None:
    """``src`` to ``dst`` with the json last (server-side copies on an object store)."""
    for rel in _commit_last(_files(fs, src)):
        fs.makedirs(_join(dst, rel).rpartition("/")[0], exist_ok=True)
        fs.copy(_join(src, rel), _join(dst, rel))


def remove_remote_checkpoint(path: _PathLike) -> None:
    """``X`` and what an interrupted save left of it (ModelCheckpoint's top-k removal; the first rank only)."""
    fs, root = _fs(as_url(path))
    if fs.isfile(root):
        fs.rm_file(root)
    _remove_tree(fs, root)
    _remove_tree(fs, _aside(root))


# -- agreement --------------------------------------------------------------------------------------------------------
def _multi(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _attempt(fn) -> Optional[BaseException]:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - handed to the agreement, raised on every rank there
        return err
    return None


def _agree(group, err: Optional[BaseException], what: str, url: str) -> None:
    """Every rank of ``group`` learns whether any failed ``what``: its own error raised where it happened,
    one error naming the failed rank everywhere else."""
    mine = None if err is None else f"{type(err).__name__}: {err}"
    every = [mine]
    if _multi(group):
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
    if err is not None:
        raise err
    failed = [(r, m) for r, m in enumerate(every) if m]
    if failed:
        r, m = failed[0]
        raise RuntimeError(f"Checkpoint {url!r}: rank {r} failed while {what} ({m}); this rank stopped too.")


# -- save -----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def remote_checkpoint_dir(path: _PathLike, group=None) -> Iterator[Path]:
    """A local staging directory the checkpoint writers fill, uploaded to ``path`` (a URL) on a clean exit of
    every rank, ``zero_checkpoint.json`` last ([Note: checkpoints at fsspec locations]). Collective over
    ``group`` (default: the world); a failure on any rank is raised on every rank, and the remote holds then
    no json of the new save."""
    url = as_url(path)
    fs, root = _fs(url)
    me = _rank(group)
    stage = Path(tempfile.mkdtemp(prefix="lightning_zero-save-", dir=staging_root()))
    failed: Optional[BaseException] = None
    try:
        try:
            yield stage
        except BaseException as err:  # noqa: BLE001 - joins the agreement so no rank waits on this one
            failed = err
        _agree(group, failed, "writing its part locally", url)  # until here the remote is untouched
        try:
            _agree(group, _attempt(lambda: _make_room(fs, root)) if me == 0 else None, "preparing the remote", url)
            _agree(group, _attempt(lambda: _upload(fs, root, stage, commit=False)), "uploading its files", url)
            _agree(group, _attempt(lambda: _upload(fs, root, stage, commit=True)), "committing", url)
        except BaseException:
            if me == 0:  # the new files without their json: never read, but not left for the next save either
                _attempt(lambda: _remove_tree(fs, root))
            raise
        if me == 0:  # the new copy is complete: the previous one is redundant
            if (err := _attempt(lambda: _remove_tree(fs, _aside(root)))) is not None:
                warnings.warn(f"Checkpoint {url!r} is complete, but removing its previous copy failed ({err}); "
                              "the next save there removes it.", stacklevel=3)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _make_room(fs, root: str) -> None:
    """Before the upload into ``root``: a complete ``X`` copied aside, then removed (json first); an
    incomplete one (an interrupted save) removed, its complete aside copy kept."""
    old = _aside(root)
    if _complete(fs, root):
        _remove_tree(fs, old)
        _copy_tree(fs, root, old)
    elif not _complete(fs, old):
        _remove_tree(fs, old)
    _remove_tree(fs, root)
    fs.makedirs(root, exist_ok=True)


def _upload(fs, root: str, stage: Path, commit: bool) -> None:
    """This rank's files (``commit``: only the top-level json, which one rank holds)."""
    for local in sorted(p for p in stage.rglob("*") if p.is_file()):
        rel = local.relative_to(stage).as_posix()
        if (rel == INFO_FILE) == commit:
            fs.makedirs(_join(root, rel).rpartition("/")[0], exist_ok=True)
            fs.put_file(str(local), _join(root, rel))
