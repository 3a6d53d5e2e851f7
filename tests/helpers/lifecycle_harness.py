"""Entry-point sequences run by tests/test_lifecycle.py, identically under ZeroStrategy and Lightning's DDP.

A sequence is a list of steps; each rank records what the user would see (metrics returned by
validate/test, predictions, whole fp32 weights after each fit, the optimizer state a resumed fit starts
from) so the test compares ZeRO's record with DDP's. ``run_external`` runs a sequence in ranks whose
process group already exists (what torchrun/SLURM give a script): one process, many Trainers, the
strategy's default (popen) launcher that launches nothing.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeroStrategy
from tests.helpers.lightning_models import ParityModule
from tests.helpers.models import make_model

Z3_UNITS = dict(unit_classes=["net.fc1", "net.fc2", "net.frozen"], persist_numel=0)  # 'sometimes' in the root
STAGES = {
    "zero0": dict(stage=0), "zero1": dict(stage=1), "zero2": dict(stage=2), "zero3": dict(stage=3, **Z3_UNITS),
    "zero2_offload": dict(stage=2, offload_optimizer=True),
    "zero3_offload": dict(stage=3, offload_optimizer=True, offload_params=True, **Z3_UNITS),
    # units kept gathered from forward to backward, two prefetched: the whole entry-point chains under the Trainer
    "zero3_keep": dict(stage=3, reshard_after_forward=False, prefetch=2, **Z3_UNITS),
}


def make_strategy(name: str, **kw):
    if name == "ddp":
        return DDPStrategy(find_unused_parameters=True, **kw)
    return ZeroStrategy(**STAGES[name], **kw)


class LifecycleModule(ParityModule):
    """ParityModule that logs its evaluation losses (so validate/test return metrics) and records the
    optimizer state it starts training from."""

    def __init__(self, out: str, seed: int = 0, tag: str = "") -> None:
        super().__init__(out, tag=tag)
        self.net = make_model(seed)
        self.start_opt_state = None

    def validation_step(self, batch, batch_idx):
        loss = super().validation_step(batch, batch_idx)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch, batch_idx):
        loss = super().test_step(batch, batch_idx)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def on_train_start(self):
        engine = getattr(self.trainer.strategy, "engine", None)
        state = engine.optimizer_state_dict() if engine is not None else self.trainer.optimizers[0].state_dict()
        self.start_opt_state = _detach(state)

    def on_train_end(self):
        pass

    def on_validation_end(self):
        pass

    def on_test_end(self):
        pass

    def on_predict_end(self):
        pass


def _detach(obj):
    if torch.is_tensor(obj):
        return obj.detach().clone().cpu()
    if isinstance(obj, dict):
        return {k: _detach(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detach(v) for v in obj)
    return obj


def whole_params(module, strategy) -> dict[str, torch.Tensor]:
    gathered = getattr(strategy, "gathered_params", None)
    with gathered() if gathered is not None else contextlib.nullcontext():
        return {k: v.detach().clone().float() for k, v in module.state_dict().items()}


def trainer(strategy, devices: int, max_steps: int, **kw) -> Trainer:
    base = dict(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0, limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2)
    base.update(kw)
    return Trainer(**base)


# -- sequences ------------------------------------------------------------------------------------------------
# Each step: (entry point, arguments). "fit" steps build a fresh Trainer (as a script that resumes does);
# evaluation steps reuse the last Trainer unless they name a checkpoint ("new").
FIT_EVAL_SAVE_RESUME = [("fit", 2), ("validate", None), ("test", None), ("predict", None), ("save", "after"),
                        ("resume", ("after", 4))]
# ...then, on a Trainer that trained further, validate from the older checkpoint (the module now holds its
# weights, as under DDP), save (those weights with the newer fit's optimizer state) and resume from that
EVAL_FIRST = [("validate", None), ("fit", 2), ("save", "dir"), ("save_full", "file"),
              ("validate_new", "dir"), ("test_new", "file"), ("predict_new", "dir"), ("validate", None),
              ("fit", 3), ("validate_ckpt", "dir"), ("save", "after_eval"), ("resume", ("after_eval", 5))]
# the chain the repetition test runs 20 times per stage (predict is covered by the two sequences above)
REPEATED = [("fit", 2), ("validate", None), ("test", None), ("save", "after"), ("resume", ("after", 4))]
SEQUENCES = {"fit_eval_save_resume": FIT_EVAL_SAVE_RESUME, "eval_first_then_ckpt_eval": EVAL_FIRST,
             "repeated": REPEATED, "fit": [("fit", 2)]}


def run_sequence(name: str, steps, devices: int, out: str, rank: int = 0) -> dict:
    """Run ``steps`` with fresh strategies of kind ``name``; returns this rank's record."""
    torch.set_num_threads(1)
    record: dict = {"metrics": [], "preds": [], "weights": [], "losses": [], "start_opt": []}
    model = LifecycleModule(out)
    t = None
    ckpts: dict[str, str] = {}

    def ckpt(key, full=False):
        if name == "ddp" or full:
            return os.path.join(out, f"{name}_{key}.ckpt")
        return os.path.join(out, f"{name}_{key}.dir")

    for what, arg in steps:
        if what == "fit":
            t = trainer(make_strategy(name), devices, arg)
            t.fit(model)
            record["weights"].append(whole_params(model, t.strategy))
            record["losses"].append(list(model.losses))
        elif what == "resume":
            key, max_steps = arg
            model = LifecycleModule(out, seed=5)  # other initial weights: everything comes from the checkpoint
            t = trainer(make_strategy(name), devices, max_steps)
            t.fit(model, ckpt_path=ckpts[key])
            record["weights"].append(whole_params(model, t.strategy))
            record["losses"].append(list(model.losses))
            record["start_opt"].append(model.start_opt_state)
        elif what in ("save", "save_full"):
            path = ckpt(arg, full=what == "save_full")
            fmt = getattr(t.strategy, "checkpoint_format", None)
            if what == "save_full" and fmt is not None:
                t.strategy.checkpoint_format = "full"
            t.save_checkpoint(path)
            if fmt is not None:
                t.strategy.checkpoint_format = fmt
            ckpts[arg] = path
        elif what == "validate_ckpt":
            _evaluate(t, "validate", model, ckpts[arg], record)
            record["weights"].append(whole_params(model, t.strategy))
        elif what in ("validate", "test", "predict"):
            if t is None:
                t = trainer(make_strategy(name), devices, 1)
            _evaluate(t, what, model, None, record)
        else:  # validate_new / test_new / predict_new: a fresh module and Trainer, weights from a checkpoint
            fresh = LifecycleModule(out, seed=9)
            _evaluate(trainer(make_strategy(name), devices, 1), what[: -len("_new")], fresh, ckpts[arg], record)
            record["weights"].append(whole_params(fresh, None))
    record["final"] = whole_params(model, t.strategy if t is not None else None)
    return record


def _evaluate(t: Trainer, what: str, model, ckpt_path, record) -> None:
    res = getattr(t, what)(model, ckpt_path=ckpt_path)
    if what == "predict":  # None in the main process of the fork/spawn launchers (as under DDP)
        record["preds"].append(None if res is None else [p.detach().float() for p in res])
    else:
        record["metrics"].append(res)


def run_external(rank: int, world_size: int, name: str, seq: str, out: str, repeats: int = 1):
    """Inside a forked rank with its process group initialized: Lightning launches nothing (LOCAL_RANK set)."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", LOCAL_WORLD_SIZE=str(world_size))
    records, threads = [], []
    for i in range(repeats):
        os.makedirs(os.path.join(out, f"rep{i}"), exist_ok=True)
        records.append(run_sequence(name, SEQUENCES[seq], world_size, os.path.join(out, f"rep{i}"), rank))
        threads.append(len(os.listdir("/proc/self/task")))  # OS threads of this process (gloo's included)
    return {"records": records, "groups": len(dist.distributed_c10d._world.pg_names), "threads": threads}


class DieOnce(Callback):
    """Global rank 1 exits hard after optimizer step ``step`` of torchrun's first attempt: a killed worker (no
    cleanup, no exception) for the elastic-restart scripts."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first and trainer.global_step == self.step and trainer.global_rank == 1:
            os._exit(17)
