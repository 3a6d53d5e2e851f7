"""Lightning glue for sharded checkpoints: the strategy methods that write and read them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from ..engine.engine_state import EngineMode
from ..checkpoint.format import (_IMPL_KEYS, _TMP, _remove, aside_path, check_optimizer_count, load_model_state,
                         load_optimizer_state, read_info, read_meta, resolve_checkpoint_dir, save_checkpoint_dir,
                         sharded_model_state, sharded_optimizer_state)
from ..checkpoint.trust import trusted

# -- Lightning glue ----------------------------------------------------------------------------------------------
_LOADED_KEY = "lightning_zero_checkpoint_dir"


class ZeroCheckpointMixin:
    """Strategy methods that make Lightning write and read ZeRO checkpoints.

    Use as ``class ZeroStrategy(ZeroCheckpointMixin, DDPStrategy)``. The host's side of the contract is the
    attributes declared below (set by ``ZeroStrategy.__init__`` and its setup / teardown) and
    ``self.precision_plugin``. ``checkpoint_format``: "sharded" (default) writes DCP
    directories; "full" writes Lightning's single file with consolidated (full, fp32) model and optimizer
    state. Both formats load in either mode, at any world size and stage.
    """

    checkpoint_format = "sharded"
    trust_checkpoint = False  # read checkpoints' pickles unrestricted (docs/security.md)
    _zero_trust = False  # this load's decision: trust_checkpoint, or Lightning's weights_only=False
    engine: Optional[Any] = None  # the live engine (None outside a setup)
    _trained_engine: Optional[Any] = None  # a finished fit's, detached ([Note: the trained state outlives fit])

    @property
    def _zero_sharded(self) -> bool:
        if self.checkpoint_format not in ("sharded", "full"):
            raise ValueError(f"checkpoint_format={self.checkpoint_format!r}; allowed: 'sharded', 'full'.")
        return self.checkpoint_format == "sharded"

    def _engine_to_save(self):
        """The engine whose state a save writes: the live one, else the detached one a finished fit left
        (see [Note: the trained state outlives fit] in strategy.py), which first adopts the module's values
        (a method, not a property: it writes the masters): once fit is over the whole module is what the user
        holds (and may have loaded or averaged)."""
        if self.engine is not None:
            return self.engine
        trained = self._trained_engine
        if trained is not None:
            trained.load_masters_from_module()
        return trained

    @property
    def _zero_optimizer_engine(self):
        """The engine holding the optimizer's shards: the live training engine, else a finished fit's."""
        engine = self.engine
        if engine is not None and engine.mode is EngineMode.TRAIN:
            return engine
        return self._trained_engine

    # -- what Lightning puts into the checkpoint dict -----------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        engine = self._engine_to_save()
        if self._zero_sharded:
            return sharded_model_state(self.lightning_module, engine)
        if engine is not None and engine.partitions_params:  # stage 3: nothing is whole in the module
            with engine.gathered_params():
                state = {k: v.clone() for k, v in super().lightning_module_state_dict().items()}
        else:
            state = super().lightning_module_state_dict()
        if engine is not None and engine.mode is EngineMode.TRAIN and engine.compute_dtype not in (None, torch.float32):
            # the module holds fp16/bf16 copies: save the fp32 masters so a resume loses nothing
            by_id = {id(p): f for p, f in zip(engine.bucket_params, engine.full_master_params())}
            for name, p in self.lightning_module.named_parameters(remove_duplicate=False):
                if id(p) in by_id:
                    state[name] = by_id[id(p)].cpu()
        return state

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        engine = self._zero_optimizer_engine
        if engine is None:
            return super().optimizer_state(optimizer)
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps the engine's
        return (sharded_optimizer_state(engine, optimizer) if self._zero_sharded
                else engine.optimizer_state_dict(optimizer))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        if not self._zero_sharded:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint(..., storage_options=...) is not supported for sharded "
                            "checkpoints (they do not go through CheckpointIO).")
        path = Path(self.broadcast(str(filepath)))
        checkpoint = dict(checkpoint)
        model_state = checkpoint.pop("state_dict")
        opt_states = checkpoint.pop("optimizer_states", None)
        engine = self._engine_to_save()
        opt = opt_states if opt_states and self._zero_optimizer_engine is not None else None
        if opt_states is not None and opt is None:
            checkpoint["optimizer_states"] = opt_states  # evaluation: no optimizer, an empty list
        save_checkpoint_dir(path, model_state, self.lightning_module, engine, opt, checkpoint, barrier=self.barrier)

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:  # a directory, a file, or save_last="link"'s symlink (never its target)
            path = Path(filepath)
            for p in (path, aside_path(path), path.with_name(path.name + _TMP)):
                _remove(p)  # an interrupted save's copies too, or the next save would rename them back

    # -- restore ------------------------------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # sharded: load into the engine's masters, which exist only after setup (as FSDPStrategy does)
        return self._zero_sharded or super().restore_checkpoint_after_setup

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = resolve_checkpoint_dir(self.broadcast(str(checkpoint_path)))
        if not path.is_dir():
            return super().load_checkpoint(path, weights_only=weights_only)
        self._zero_trust = trusted(self.trust_checkpoint, weights_only)
        read_info(path, self._zero_trust)
        meta = read_meta(path, trust_checkpoint=self._zero_trust)
        meta[_LOADED_KEY] = str(path)
        return meta

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        engine = self.engine
        if _LOADED_KEY in checkpoint:
            load_model_state(checkpoint[_LOADED_KEY], self.lightning_module, engine, strict,
                             trust_checkpoint=self._zero_trust)
            return
        if engine is not None:  # a single file loaded after setup: into the module, masters and shards
            engine.load_full_state_dict(checkpoint["state_dict"], strict=strict)
            return
        super().load_model_state_dict(checkpoint, strict=strict)

    def _add_saved_param_groups(self, opt, saved: list) -> None:
        """Groups the saved run added after setup (``add_param_group``, e.g. BaseFinetuning): add them again,
        by parameter name, so the state has somewhere to go. Lightning's own restore of them
        (``BaseFinetuning.on_fit_start``) runs before a sharded checkpoint is read, too early."""
        named = dict(self.lightning_module.named_parameters())
        for g in saved[len(opt.param_groups):]:
            if not all(n in named for n in g["params"]):
                return  # not this model's names: the mismatch error follows with the details
            opt.add_param_group({**{k: v for k, v in g.items() if k not in _IMPL_KEYS},
                                 "params": [named[n] for n in g["params"]]})

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        engine = self.engine
        states = checkpoint.get("optimizer_states") or []
        if engine is None or not states:
            return
        check_optimizer_count(checkpoint.get(_LOADED_KEY, "<checkpoint>"), len(states), len(engine.optimizers))
        for k, (opt, state) in enumerate(zip(engine.optimizers, states)):
            if _LOADED_KEY in checkpoint:
                self._add_saved_param_groups(opt, state["param_groups"])
                load_optimizer_state(checkpoint[_LOADED_KEY], engine, state, index=k,
                                     trust_checkpoint=self._zero_trust)
            else:  # a full (consolidated) state from any world size
                engine.load_optimizer_state_dict(state, opt)
