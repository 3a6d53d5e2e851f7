"""``async_save=True`` for the Trainer's and Fabric's strategies: the knob's check, and a sharded save handed to
the background writer ([Note: asynchronous checkpoint saves], checkpoint/async_save.py).

Where the Lightning layer calls the writer: each save (``trainer.save_checkpoint`` -- ModelCheckpoint's too --
and ``fabric.save``) stages and returns; each training step (Trainer: ``training_step``; Fabric:
``fabric.backward``) raises a failed write; ModelCheckpoint's removal of a checkpoint that left its top-k waits
for the save in flight; teardown waits for the last write and raises its failure. Outside a run (after
``fit`` returned, before ``setup``) a save is written at once -- there is no later step or teardown to report a
failure at.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.utilities.rank_zero import rank_zero_info

from ..checkpoint.async_save import AsyncCheckpointer
from ..checkpoint.files import _remove, is_checkpoint_dir
from ..checkpoint.format import save_in_background  # noqa: F401  (the Lightning hooks' entry)

# a failed run's teardown: a peer that died mid-write never joins the writer's collectives
FAILED_RUN_WAIT_S = 120.0


def async_saver(async_save: Any, checkpoint_format: str = "sharded") -> Optional[AsyncCheckpointer]:
    """The writer of ``async_save=True`` (None: saves are synchronous)."""
    if not isinstance(async_save, bool):
        raise ValueError(f"async_save must be True or False; got {async_save!r}.")
    if async_save and checkpoint_format != "sharded":
        raise ValueError(f"async_save=True writes sharded checkpoint directories; checkpoint_format="
                         f"{checkpoint_format!r} is a single file written by Lightning's CheckpointIO. Allowed: "
                         "checkpoint_format='sharded' with async_save=True, or Lightning's AsyncCheckpointIO plugin "
                         "for single files.")
    return AsyncCheckpointer() if async_save else None


def finish_saves(saver: Optional[AsyncCheckpointer], failed: bool) -> None:
    """Teardown: the last write waited for and its failure raised; after a failed run only logged (the error
    that stopped the run stays the one the user sees) and waited for at most ``FAILED_RUN_WAIT_S``."""
    if saver is None:
        return
    if not failed:
        saver.close()
        line = saver.summary()
        if line is not None:
            rank_zero_info(line)
        saver.records.clear()  # the next run of this strategy counts its own
        return
    try:
        saver.close(FAILED_RUN_WAIT_S)
    except Exception as err:
        import logging

        logging.getLogger("lightning_zero.checkpoint").error("lightning_zero: %s", err)


_PREV = ".zero-prev"  # last.ckpt -> last.zero-prev.ckpt: a name Lightning's ckpt_path="last" search still finds


def keep_last_links(directory) -> list[Path]:
    """Before a background save in ``directory`` (rank 0): each ``last*.ckpt`` link to a complete checkpoint
    gets a twin, ``last*.zero-prev.ckpt``, to the same target, removed once the save is complete.

    ``ModelCheckpoint(save_last="link")`` repoints ``last.ckpt`` at the new checkpoint as soon as the save is
    asked for, and the new directory appears only when the background write completes: a process that dies in
    between would leave ``last.ckpt`` naming nothing, and ``fit(ckpt_path="last")`` -- which skips a link to
    nothing -- would find no last checkpoint at all. Its search takes any ``last*.ckpt``, so it finds the twin,
    whose target (the previous last checkpoint) the save does not touch: top-k removals wait for the commit."""
    directory = Path(directory)
    made: list[Path] = []
    if not directory.is_dir():
        return made
    for entry in os.scandir(directory):
        link = Path(entry.path)
        if (not entry.is_symlink() or not link.name.startswith("last") or link.suffix != ".ckpt"
                or _PREV in link.name or not is_checkpoint_dir(link)):
            continue
        twin = link.with_name(link.stem + _PREV + link.suffix)
        staging = twin.with_name(twin.name + ".new")
        _remove(staging)
        os.symlink(os.readlink(link), staging)
        os.replace(staging, twin)  # an earlier save's twin (one that failed) replaced in one step
        made.append(twin)
    return made


def drop_links(links: list[Path]) -> None:
    for link in links:
        if os.path.islink(link):
            os.unlink(link)
