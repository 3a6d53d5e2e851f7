"""A damaged NVMe scratch file stops the run ([Note: verified scratch reads], engine/placement/nvme_checksums.py).

Mid-run, after step 2, a scratch file is truncated, overwritten with 0xFF, or deleted -- the optimizer's file
(zero2 / zero3) or stage 3's parameter file -- at 1 and 2 ranks:

* truncated or overwritten: the next step raises one error on every rank, the same words, naming the damaged
  file and what is wrong with it; through the Trainer (the registered ``*_offload_nvme`` presets, default
  arguments) no checkpoint is saved after the damage;
* overwritten, then a checkpoint saved: the save reads every shard back, and the damaged rank's error is
  raised on every rank before the save's collectives (no checkpoint directory is written);
* deleted: the run holds the file open, so the bytes are still its own: it trains on exactly the numbers of
  an untouched run and tears down cleanly;
* the checksum map itself: a rewrite of one parameter's slice keeps the other slices verified; a write that
  cuts a recorded block is refused.
"""

from __future__ import annotations

import glob
import re
import os

import pytest
import torch

from lightning_zero.engine import ZeroConfig, ZeroEngine
from lightning_zero.engine.placement.nvme_checksums import BlockChecksums, ScratchDamaged
from lightning_zero.engine.placement.nvme_space import reclaim_dead_files
from tests.helpers.dist_utils import run_distributed
from tests.helpers.nvme_models import STACK_UNITS, Stack, swap_files

DAMAGE = {  # what is done to the file -> the words the error must carry (None: the run is unaffected)
    "truncate": r"is damaged: reading [\d,]+ bytes at offset [\d,]+ stopped after [\d,]+ at the file's end .*truncated",
    "overwrite": r"is damaged: the [\d,]+ bytes at offset [\d,]+ do not match the CRC32 written with them",
    "delete": None,
}


def damage(path: str, how: str) -> None:
    if how == "truncate":
        os.truncate(path, os.path.getsize(path) // 3)
    elif how == "overwrite":
        size = os.path.getsize(path)
        with open(path, "r+b") as fh:
            fh.write(b"\xff" * size)
    else:
        os.unlink(path)


def scratch_of(path: str, kind: str, rank: int) -> str:
    (name,) = [f for f in swap_files(path) if f.startswith(f"lightning_zero-{kind}-rank{rank}-")]
    return os.path.join(path, name)


def _engine(path: str, stage: int):
    torch.manual_seed(0)
    model = Stack(6, 16)
    cfg = ZeroConfig(stage=stage, offload_optimizer="nvme", offload_params="nvme" if stage == 3 else False,
                     nvme_path=path, bucket_mb=0.002, **(STACK_UNITS if stage == 3 else {}))
    return model, ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg)


def _run(rank, world_size, path, stage, kind, how, damaged_rank):
    """Four steps; after the second, ``damaged_rank``'s ``kind`` file is damaged ``how`` (None: untouched)."""
    model, engine = _engine(path, stage)
    losses, error = [], None
    for step in range(4):
        if step == 2 and how is not None and rank == damaged_rank:
            damage(scratch_of(path, kind, rank), how)
        try:
            loss = model(torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank)))
            loss.backward()
            engine.step()
        except RuntimeError as e:
            error = str(e)
            break
        losses.append(loss.item())
    engine.remove(hand_back=False)
    return losses, error


CASES = [(2, "optimizer"), (3, "optimizer"), (3, "params")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,kind", CASES)
@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_damaged_scratch_file_at_one_rank(tmp_path, stage, kind, how):
    (untouched, _), = run_distributed(_run, 1, str(tmp_path), stage, kind, None, 0)
    (losses, error), = run_distributed(_run, 1, str(tmp_path), stage, kind, how, 0)
    if DAMAGE[how] is None:
        assert error is None and losses == untouched  # its own bytes, through the open file
    else:
        knob = "offload_params" if kind == "params" else "offload_optimizer"
        assert error is not None, f"{how} of the {kind} file trained on: {losses} vs {untouched}"
        assert f"{knob}='nvme': on rank 0, scratch file " in error and f"lightning_zero-{kind}-rank0-" in error
        assert re.search(DAMAGE[how], error), error
        assert "The run stops on every rank" in error
        assert losses == untouched[:2]  # the steps before the damage are the untouched run's
    assert swap_files(str(tmp_path)) == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,kind", CASES)
@pytest.mark.parametrize("how", ["truncate", "overwrite"])
def test_a_damaged_scratch_file_on_one_of_two_ranks_stops_both_with_its_error(tmp_path, stage, kind, how):
    first, second = run_distributed(_run, 2, str(tmp_path), stage, kind, how, 1)
    assert first[1] is not None and first[1] == second[1], (first, second)
    assert "on rank 1, scratch file " in first[1] and f"lightning_zero-{kind}-rank1-" in first[1], first[1]
    assert re.search(DAMAGE[how], first[1]), first[1]
    assert len(first[0]) == len(second[0]) == 2
    assert swap_files(str(tmp_path)) == []


# -- the Trainer, the registered presets, default arguments -------------------------------------------------------
def _damaging_callback(scratch: str, kind: str, how: str, ranks):
    from lightning.pytorch import Callback

    class Damage(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1 and trainer.global_rank in ranks:  # after step 2
                damage(scratch_of(scratch, kind, trainer.global_rank), how)

    return Damage()


def _recording_module(out: str):
    """ParityModule whose optimizer step writes the error it raises, every rank, before any rank exits (the
    launcher stops the other ranks as soon as one has failed)."""
    from tests.helpers.lightning_models import ParityModule

    class Recording(ParityModule):
        def optimizer_step(self, *args, **kwargs):
            try:
                return super().optimizer_step(*args, **kwargs)
            except RuntimeError as e:
                with open(os.path.join(out, f"error{self.global_rank}"), "w") as fh:
                    fh.write(str(e))
                if torch.distributed.is_initialized():
                    torch.distributed.barrier()
                raise

    return Recording(out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset,devices,kind,how", [
    ("zero3_offload_nvme_fork", 2, "optimizer", "truncate"),  # the outside pass's reproduction
    ("zero2_offload_nvme", 1, "optimizer", "overwrite"),
    ("zero3_offload_nvme", 1, "params", "truncate"),
])
def test_trainer_stops_on_a_damaged_scratch_file_and_saves_no_checkpoint(tmp_path, monkeypatch, preset, devices,
                                                                          kind, how):
    from lightning.pytorch import Trainer

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("LIGHTNING_ZERO_NVME_PATH", str(scratch))  # the presets' nvme_path (inherited by the ranks)
    trainer = Trainer(strategy=preset, accelerator="cpu", devices=devices, max_steps=4, logger=False,
                      enable_progress_bar=False, default_root_dir=str(tmp_path),
                      callbacks=[_damaging_callback(str(scratch), kind, how, ranks=(0,))])
    with pytest.raises(Exception):
        trainer.fit(_recording_module(str(tmp_path)))
    errors = [(tmp_path / f"error{r}").read_text() for r in range(devices)]
    assert all(e == errors[0] for e in errors), errors  # one error, the same on every rank
    assert "on rank 0, scratch file " in errors[0] and re.search(DAMAGE[how], errors[0]), errors[0]
    assert glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True) == []  # nothing trained on it is saved
    # in the test's process the Trainer tears down (files removed); forked ranks that raised exit without it: the
    # next run on the directory reclaims their files (nvme_space.py), as this does
    reclaim_dead_files(str(scratch))
    assert os.listdir(scratch) == []


# -- the checksum map ----------------------------------------------------------------------------------------------
def _bytes(n: int, seed: int) -> memoryview:
    return memoryview(bytes((seed + 7 * i) % 251 for i in range(n)))


def test_a_slice_rewritten_in_its_own_block_keeps_the_others_verified():
    sums = BlockChecksums()
    region = bytearray(_bytes(300, 1))
    sums.record(memoryview(region), 1000, [100, 50, 150])  # one region written whole, in its pieces
    region[100:150] = _bytes(50, 9)
    sums.record(memoryview(region)[100:150], 1100)  # the publish rewrites one piece
    sums.verify(memoryview(region), 1000, "f")
    region[10] ^= 1
    with pytest.raises(ScratchDamaged, match=r"scratch file f is damaged: the 100 bytes at offset 1,000 do not"):
        sums.verify(memoryview(region), 1000, "f")
    with pytest.raises(RuntimeError, match="cuts the block written at 1150"):
        sums.record(_bytes(10, 3), 1200)
    with pytest.raises(RuntimeError, match="bytes this run never wrote"):
        sums.verify(_bytes(400, 1), 1000, "f")
    sums.forget_from(1150)
    sums.verify(memoryview(region)[100:150], 1100, "f")
    assert len(sums) == 2


def _save_after_damage(rank, world_size, path, ckpt, stage, kind):
    """Two steps, then rank 1's ``kind`` file overwritten, then a checkpoint save on every rank (a whole view
    reads every shard back): the error must reach every rank, not only the one whose read failed."""
    from lightning_zero.checkpoint import save_engine_checkpoint

    model, engine = _engine(path, stage)
    for step in range(2):
        model(torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))).backward()
        engine.step()
    if rank == 1:
        damage(scratch_of(path, kind, rank), "overwrite")
    try:
        save_engine_checkpoint(ckpt, model, engine)
        error = None
    except RuntimeError as e:
        error = str(e)
    engine.remove(hand_back=False)
    return error


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage,kind", CASES)
def test_a_damaged_scratch_file_stops_a_checkpoint_save_on_every_rank(tmp_path, stage, kind):
    path, ckpt = tmp_path / "nvme", tmp_path / "ckpt"
    path.mkdir()
    errors = run_distributed(_save_after_damage, 2, str(path), str(ckpt), stage, kind)
    knob = "offload_params" if kind == "params" else "offload_optimizer"
    for error in errors:
        assert error is not None and f"{knob}='nvme': on rank 1, scratch file " in error, errors
        assert re.search(DAMAGE["overwrite"], error) and "nothing was saved" in error, error
    assert errors[0] == errors[1]
    assert not ckpt.exists()  # no checkpoint directory with damaged numbers in it
    assert swap_files(str(path)) == []
