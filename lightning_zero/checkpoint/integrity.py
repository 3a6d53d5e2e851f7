"""Integrity of a checkpoint directory: every file a save wrote, with its size and CRC-32, in
``zero_checkpoint.json``; the json itself sealed with the CRC-32 of its own content.

Design note
-----------
CRC-32 (``zlib.crc32``, streamed in 8 MiB reads) is the fastest of the stdlib's digests here (about 3.9 GB/s
on one core, against 0.6-0.9 GB/s for blake2b / sha256) and catches what happens to files by accident: a
truncated copy, a disk full half-way, flipped bits. It is not a signature: whoever can rewrite a file can
rewrite the json too (see docs/security.md); what keeps such a file from running code is ``trust.py``.

The writer lists files after they are complete, hashed in parallel: each rank the DCP files it wrote, the
first rank ``.metadata`` and ``meta.pt``. Readers verify before any tensor is read; a directory verified once
in a process is not hashed again while its files' size and mtime are unchanged (the Trainer reads the json
three times per resume). Checkpoints written before checksums existed have no ``files`` entry and load
as before, unverified.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Optional, Union

from .trust import confined

FILES_KEY, SEAL_KEY = "files", "info_crc32"
_CHUNK = 8 * 2**20
_PathLike = Union[str, os.PathLike]
_VERIFIED: dict[tuple[str, str], tuple] = {}
_FAILED = "\0failed"  # a key no file name has: a rank's listing that failed


def file_crc32(file: _PathLike) -> str:
    crc = 0
    with open(file, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def describe_files(directory: _PathLike, names) -> dict[str, dict]:
    """{name: {"size", "crc32"}} of ``names`` (relative to ``directory``)."""
    directory = Path(directory)
    return {n: {"size": os.path.getsize(directory / n), "crc32": file_crc32(directory / n)} for n in sorted(names)}


def written_files(directory: _PathLike, exclude: str) -> list[str]:
    """Every regular file directly in ``directory`` but ``exclude`` (the json being written)."""
    return sorted(e.name for e in os.scandir(directory) if e.is_file(follow_symlinks=False) and e.name != exclude)


def describe_written(directory: _PathLike, exclude: str, group=None) -> Optional[dict[str, dict]]:
    """:func:`describe_files` of every file a save wrote into ``directory``, hashed in parallel: each rank of
    ``group`` the DCP files it wrote itself (``__<rank>_*``, complete once its ``dcp.save`` returns), the
    group's first rank what is left (``.metadata``, ``meta.pt``, any file of another name). Collective over
    ``group``; the dict on its first rank, None elsewhere."""
    import torch.distributed as dist

    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    me = dist.get_rank(group) if multi else 0
    try:
        names = written_files(directory, exclude)
        mine = describe_files(directory, [n for n in names if n.startswith(f"__{me}_") and n.endswith(".distcp")])
    except OSError as err:  # still join the gather: a rank that left it would leave its peers waiting
        mine = {_FAILED: f"{type(err).__name__}: {err}"}
    every = [mine]
    if multi:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
    failed = {r: part[_FAILED] for r, part in enumerate(every) if _FAILED in part}
    if failed:
        err = OSError(f"Listing the files of {str(directory)!r} failed on rank(s) {sorted(failed)}.")
        err.rank_failures = failed  # which ranks failed, for the save's agreement (atomic.py)
        raise err
    if me != 0:
        return None
    found = {n: d for part in every for n, d in part.items()}
    names = written_files(directory, exclude)  # after the gather: every rank's files are complete
    found.update(describe_files(directory, [n for n in names if n not in found]))
    return dict(sorted(found.items()))


def _canonical(info: dict) -> bytes:
    return json.dumps({k: v for k, v in info.items() if k != SEAL_KEY}, sort_keys=True,
                      separators=(",", ":")).encode()


def seal(info: dict) -> dict:
    """``info`` with its own CRC-32 (computed over what json gives back, so a reader recomputes it exactly)."""
    info = json.loads(json.dumps(info))
    info[SEAL_KEY] = f"{zlib.crc32(_canonical(info)):08x}"
    return info


def verify(directory: _PathLike, info: dict, info_file: str) -> None:
    """The json's seal, then every listed file's size and CRC-32: one ValueError naming the first file that
    is missing, truncated or altered. A json without a seal or list (an older build) passes unverified."""
    directory = Path(directory)
    where = f"Corrupt checkpoint {str(directory)!r}"
    if SEAL_KEY in info and info[SEAL_KEY] != f"{zlib.crc32(_canonical(info)):08x}":
        raise ValueError(f"{where}: {info_file} was altered after it was written (its CRC-32 does not match its "
                         "content). Load an earlier checkpoint.")
    files = info.get(FILES_KEY)
    if files is None:
        return
    if not isinstance(files, dict) or not all(isinstance(d, dict) and isinstance(d.get("size"), int) and
                                              isinstance(d.get("crc32"), str) for d in files.values()):
        raise ValueError(f"{where}: {info_file} {FILES_KEY!r} must map each file name to "
                         "{'size': int, 'crc32': hex string}.")
    for name, want in files.items():
        file = confined(directory, name, f"{info_file} file")
        try:
            st = os.stat(file)
        except FileNotFoundError:
            raise FileNotFoundError(f"Incomplete or corrupt checkpoint {str(directory)!r}: {name} is missing (listed "
                                    f"in {info_file}). Load an earlier checkpoint.") from None
        if st.st_size != want["size"]:
            raise ValueError(f"{where}: {name} is truncated or altered: {st.st_size} bytes, the save wrote "
                             f"{want['size']}. Load an earlier checkpoint.")
        key = (os.path.realpath(file), want["crc32"])
        stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
        if _VERIFIED.get(key) == stamp:
            continue
        got = file_crc32(file)
        if got != want["crc32"]:
            raise ValueError(f"{where}: {name} is altered or damaged: CRC-32 {got}, the save wrote "
                             f"{want['crc32']}. Load an earlier checkpoint.")
        _VERIFIED[key] = stamp


def check_listed(directory: _PathLike, info: dict, names, info_file: str, what: str) -> None:
    """Every file in ``names`` (those another file will read) must be among the listed ones."""
    files = info.get(FILES_KEY)
    if files is None:
        return
    unlisted = sorted(n for n in names if n not in files)
    if unlisted:
        raise ValueError(f"Corrupt checkpoint {str(directory)!r}: {what} reads {unlisted[:5]}, which the save did "
                         f"not write (not listed in {info_file}).")
