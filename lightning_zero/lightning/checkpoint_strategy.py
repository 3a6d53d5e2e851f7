"""What ZeroStrategy's checkpoint hooks do: ZeRO state into Lightning's checkpoint dict and directories, and back.

Design note
-----------
:class:`TrainerCheckpoints` is a collaborator, not a base class: ``ZeroStrategy`` defines Lightning's hooks
(``lightning_module_state_dict``, ``save_checkpoint``, ``load_checkpoint``, ...), its model side
(engine_side.py) hands this object what each call needs -- the module, the engine to save or load, the
strategy's ``broadcast`` / ``barrier`` -- and takes Lightning's own behaviour where ZeRO has nothing to add (a
single file, no engine).
``checkpoint_format``: "sharded" (default) writes DCP directories; "full" writes Lightning's single file with
consolidated (full, fp32) model and optimizer state. Both formats load in either mode, at any world size and
stage. The pipeline's model side has its own collaborator (pipeline_checkpoint_strategy.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

from ..engine.engine_state import EngineMode
from ..engine.optim.onebit import local_models as LM
from ..checkpoint.format import (_IMPL_KEYS, _TMP, _remove, aside_path, check_optimizer_count, load_model_state,
                         load_optimizer_state, read_info, read_meta, save_checkpoint_dir,
                         sharded_model_state, sharded_optimizer_state)
from ..checkpoint.location import is_remote, remove_remote_checkpoint
from ..checkpoint.trainable_only import trainable_only_state
from ..checkpoint.trust import trusted
from ..engine.comm.collectives import rank as _rank
from .async_saves import async_saver, drop_links, keep_last_links, save_in_background

# -- Lightning glue ----------------------------------------------------------------------------------------------
_LOADED_KEY = "lightning_zero_checkpoint_dir"


class TrainerCheckpoints:
    """ZeroStrategy's checkpoint format, trust decision and directory reads and writes."""

    def __init__(self, checkpoint_format: str, trust_checkpoint: bool, async_save: bool = False,
                 trainable_only_base: Optional[str] = None) -> None:
        self.checkpoint_format = checkpoint_format
        self.trainable_only_base = trainable_only_base  # the frozen base's source; None: every tensor saved
        self.trust_checkpoint = trust_checkpoint  # read checkpoints' pickles unrestricted (docs/security.md)
        self._trust = False  # this load's decision: trust_checkpoint, or Lightning's weights_only=False
        self.saver = async_saver(async_save, checkpoint_format)

    @property
    def checkpoint_format(self) -> str:
        return "sharded" if self.sharded else "full"

    @checkpoint_format.setter
    def checkpoint_format(self, value: str) -> None:
        if value not in ("sharded", "full"):
            raise ValueError(f"checkpoint_format={value!r}; allowed: 'sharded', 'full'.")
        self.sharded = value == "sharded"

    # -- what Lightning puts into the checkpoint dict -----------------------------------------------------
    def module_state(self, module, engine, lightning_state: Callable[[], dict]) -> dict[str, Any]:
        """The "state_dict" entry: DCP tensors (sharded), or the whole fp32 weights (full; ``lightning_state``
        is Lightning's own ``lightning_module_state_dict``)."""
        if self.sharded:
            return sharded_model_state(module, engine)
        if engine is not None:  # NVMe: a damaged read stops every rank, not one rank inside the save
            engine.make_states_resident()
        if engine is not None and engine.partitions_params:  # stage 3: nothing is whole in the module
            with engine.gathered_params():
                state = {k: v.clone() for k, v in lightning_state().items()}
        else:
            state = lightning_state()
        if engine is not None and engine.mode is EngineMode.TRAIN and engine.compute_dtype not in (None, torch.float32):
            # the module holds fp16/bf16 copies: save the fp32 masters so a resume loses nothing
            by_id = {id(p): f for p, f in zip(engine.bucket_params, engine.full_master_params())}
            for name, p in module.named_parameters(remove_duplicate=False):
                if id(p) in by_id:
                    state[name] = by_id[id(p)].cpu()
        if engine is not None and engine.mode is EngineMode.TRAIN:
            # 0/1 Adam between synchronizations: the one model is the ranks' mean ([Note: the ranks' own models])
            mean = LM.mean_masters(engine)
            by_id = {id(p): mean[id(m)].view(shape) for p, (_, m, _, shape) in
                     zip(engine.bucket_params, engine.master_items()) if id(m) in mean}
            for name, p in module.named_parameters(remove_duplicate=False):
                if id(p) in by_id:
                    state[name] = by_id[id(p)].to(state[name].dtype).cpu()
        return state

    def optimizer_state(self, engine, optimizer) -> dict[str, Any]:
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps the engine's
        return sharded_optimizer_state(engine, optimizer) if self.sharded else engine.optimizer_state_dict(optimizer)

    def save(self, path: Path, checkpoint: dict[str, Any], module, engine, optimizer_engine, barrier,
             in_background: bool = False) -> None:
        """A sharded directory at ``path`` (every rank calls it; ``path`` already agreed). ``in_background``:
        written by the async saver ([Note: asynchronous checkpoint saves]); else now, after any save in flight."""
        checkpoint = dict(checkpoint)
        model_state = checkpoint.pop("state_dict")
        opt_states = checkpoint.pop("optimizer_states", None)
        opt = opt_states if opt_states and optimizer_engine is not None else None
        if opt_states is not None and opt is None:
            checkpoint["optimizer_states"] = opt_states  # evaluation: no optimizer, an empty list
        if self.trainable_only_base is not None:  # [Note: trainable-only checkpoints]; collective: before any thread
            model_state, checkpoint = trainable_only_state(module, engine, model_state, self.trainable_only_base,
                                                           checkpoint)
        if self.saver is None or not in_background:
            if self.saver is not None:
                self.saver.wait()
            save_checkpoint_dir(path, model_state, module, engine, opt, checkpoint, barrier=barrier)
            return
        self.saver.wait()  # the save in flight commits (and drops its twins, below) before this one's are made
        twins = keep_last_links(Path(path).parent) if _rank() == 0 and not is_remote(path) else []
        save_in_background(self.saver, path, model_state, module, engine, opt, checkpoint)
        if twins:
            self.saver.after_commit(lambda: drop_links(twins))

    def remove(self, filepath) -> None:
        """A directory, a file, or save_last="link"'s symlink (never its target), with what an interrupted save
        left of it (or the next save would rename those back); at an fsspec URL too. With a save in flight, once it
        is complete: ModelCheckpoint drops the checkpoint the new one replaces in its top-k as soon as it asked for
        the new one."""
        def remove() -> None:
            if is_remote(filepath):
                remove_remote_checkpoint(filepath)
                return
            path = Path(filepath)
            for p in (path, aside_path(path), path.with_name(path.name + _TMP)):
                _remove(p)

        if self.saver is None:
            remove()
        else:
            self.saver.after_commit(remove)

    # -- restore ------------------------------------------------------------------------------------------------
    def read(self, path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
        """Lightning's checkpoint dict of a ZeRO directory (tensors stay on disk until the model loads)."""
        self._trust = trusted(self.trust_checkpoint, weights_only)
        read_info(path, self._trust)
        meta = read_meta(path, trust_checkpoint=self._trust)
        meta[_LOADED_KEY] = str(path)
        return meta

    def load_model(self, checkpoint: Mapping[str, Any], module, engine, strict: bool) -> bool:
        """Into the module / engine; False: nothing of ZeRO's to do (Lightning's own load applies)."""
        if _LOADED_KEY in checkpoint:
            load_model_state(checkpoint[_LOADED_KEY], module, engine, strict, trust_checkpoint=self._trust)
            return True
        if engine is not None:  # a single file loaded after setup: into the module, masters and shards
            engine.load_full_state_dict(checkpoint["state_dict"], strict=strict)
            return True
        return False

    def load_optimizers(self, checkpoint: Mapping[str, Any], module, engine) -> None:
        states = checkpoint.get("optimizer_states") or []
        if engine is None or not states:
            return
        check_optimizer_count(checkpoint.get(_LOADED_KEY, "<checkpoint>"), len(states), len(engine.optimizers))
        for k, (opt, state) in enumerate(zip(engine.optimizers, states)):
            if _LOADED_KEY in checkpoint:
                _add_saved_param_groups(module, opt, state["param_groups"])
                load_optimizer_state(checkpoint[_LOADED_KEY], engine, state, index=k, trust_checkpoint=self._trust)
            else:  # a full (consolidated) state from any world size
                engine.load_optimizer_state_dict(state, opt)


def _add_saved_param_groups(module, opt, saved: list) -> None:
    """Groups the saved run added after setup (``add_param_group``, e.g. BaseFinetuning): add them again, by
    parameter name, so the state has somewhere to go. Lightning's own restore of them
    (``BaseFinetuning.on_fit_start``) runs before a sharded checkpoint is read, too early."""
    named = dict(module.named_parameters())
    for g in saved[len(opt.param_groups):]:
        if not all(n in named for n in g["params"]):
            return  # not this model's names: the mismatch error follows with the details
        opt.add_param_group({**{k: v for k, v in g.items() if k not in _IMPL_KEYS},
                             "params": [named[n] for n in g["params"]]})
