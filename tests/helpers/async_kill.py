"""A Trainer run killed while a background checkpoint write is in progress (tests/test_async_save_kill.py).

``python -m tests.helpers.async_kill OUT MODE``; MODE is "reference" (synchronous saves, uninterrupted),
"killed" (asynchronous saves; the write of the step-4 checkpoint announces itself in OUT/writing and then
stalls until the test kills the process group) or "resume" (from OUT/ckpt/last.ckpt, asynchronous saves);
"killed_link" / "resume_link": the same with ``save_last="link"`` and ``fit(ckpt_path="last")``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_zero  # noqa: F401
from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import async_save
from tests.helpers.ckpt_models import TiedParityModule
from tests.helpers.lightning_models import trainer_kwargs


def main(out: str, mode: str) -> None:
    torch.set_num_threads(1)
    link = mode.endswith("_link")  # ModelCheckpoint(save_last="link"), resumed with ckpt_path="last"
    ckpt = Path(out) / ("ckpt_ref" if mode == "reference" else "ckpt_link" if link else "ckpt")
    if mode.startswith("killed"):
        real = async_save.write_prepared

        def stalled(directory, prepared, group=None):
            if "step=4" in str(directory):
                (Path(out) / "writing").write_text("the step-4 write has begun")
                time.sleep(600)
            return real(directory, prepared, group)

        async_save.write_prepared = stalled
    callbacks = [ModelCheckpoint(dirpath=ckpt, filename="{step}", save_top_k=-1, every_n_train_steps=2,
                                 save_last="link" if link else True)]
    trainer = Trainer(strategy=ZeroStrategy(stage=3, start_method="fork", async_save=mode != "reference"),
                      callbacks=callbacks, **trainer_kwargs(devices=2, max_steps=6, limit_train_batches=2,
                                                            enable_checkpointing=True))
    resume = "last" if mode == "resume_link" else str(ckpt / "last.ckpt") if mode == "resume" else None
    trainer.fit(TiedParityModule(out, tag=f"{mode}_"), ckpt_path=resume)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
