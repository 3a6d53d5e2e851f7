"""``fabric.save`` / ``fabric.load`` on the Trainer's checkpoint directories.

Design note
-----------
Fabric saves a dict of named objects (``{"model": model, "optimizer": opt, "step": 5}``); the Trainer a
checkpoint dict (``state_dict``, ``optimizer_states``, loops, ...). Both become the same directory
(``checkpoint/format.py``): the model entry is the DCP "model" tensors, the optimizers are the engine's
optimizers in order ("optim", "optim_1", ...; their param groups in ``optimizer_states``), the precision
state sits under the Trainer's key (``ZeroPrecision``) and every other entry is a top-level key of
``meta.pt``, as Fabric's DDP would write it. The few keys the Trainer's resume requires
(``pytorch-lightning_version``, ``lr_schedulers``) are added when missing, and listed under
``_FABRIC_KEY`` so ``fabric.load`` returns exactly the user's other entries. So a Fabric checkpoint
resumes under the Trainer (weights, optimizer state, loss scale; the Trainer's loop counters start at 0)
and a Trainer checkpoint loads under Fabric (its loops, epoch, ... come back as the remainder), each at
any world size and stage. Single files (Fabric DDP, ``torch.save``) load too, into the engine.

Several models in the state (``{"g": g, "d": d, "opt_g": ..., "opt_d": ..., "step": 5}``) are written as
one directory holding each model's own such directory with its optimizers (``checkpoint/models_dir.py``),
the other entries in the top ``meta.pt``; each model reshards on load and consolidates on its own. One
model keeps the single directory above, unchanged. ``fabric.load`` restores the models and optimizers
requested, by key (strict: each must be in the checkpoint), at any world size and stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import lightning
from torch.nn import Module
from torch.optim import Optimizer

from ..checkpoint.files import META_FILE
from ..checkpoint.format import (load_model_state, load_optimizer_state, read_info, read_meta,
                                 resolve_checkpoint_dir, save_checkpoint_dir, sharded_model_state,
                                 sharded_optimizer_state)
from ..checkpoint.local_copies import fetch_checkpoint
from ..checkpoint.models_dir import (SavedModel, is_models_checkpoint, model_checkpoint, read_models_manifest,
                                     save_models_checkpoint)
from ..checkpoint.trust import trusted
from ..checkpoint.trainable_only import trainable_only_state
from .async_saves import async_saver, save_in_background
from .compat import Stateful
from .lightning_io import load_as_lightning_checkpoint
from .precision import ZeroPrecision

_FABRIC_KEY = "lightning_zero_fabric"  # which entries were the model / optimizers, which keys were added
_PRECISION_KEY = ZeroPrecision.__qualname__  # where the Trainer keeps (and restores) the plugin's state


class FabricCheckpoints:
    """What ``ZeroFabricStrategy.save_checkpoint`` / ``load_checkpoint`` do. ``host`` is the strategy: it gives
    ``_model_of(module)`` (the set-up model holding a module), ``precision`` (its ``engine_for(optimizer)`` and
    state), ``broadcast`` / ``barrier`` and ``checkpoint_io`` (single files); nothing else is read from it."""

    def __init__(self, host: Any, trust_checkpoint: bool, async_save: bool = False,
                 trainable_only_base: Optional[str] = None) -> None:
        self.host = host
        self.trust_checkpoint = trust_checkpoint  # the strategy's knob (docs/security.md)
        self.saver = async_saver(async_save)  # None: every save written before fabric.save returns
        self.trainable_only_base = trainable_only_base  # [Note: trainable-only checkpoints]; None: all saved

    def _split_state(self, state: dict) -> tuple[list[tuple[str, Module]], list[tuple[str, Optimizer]], dict]:
        modules = [(k, v) for k, v in state.items() if isinstance(v, Module)]
        optimizers = [(k, v) for k, v in state.items() if isinstance(v, Optimizer)]
        others = {k: v for k, v in state.items() if not isinstance(v, (Module, Optimizer))}
        return modules, optimizers, others

    def _engine_of(self, module: Module):
        model = self.host._model_of(module)
        return model.engine if model is not None else None

    def _optimizer_engine(self, optimizer: Optimizer, key) -> tuple[Any, int]:
        """The engine sharding ``optimizer`` and the optimizer's index in it."""
        engine = self.host.precision.engine_for(optimizer)
        if engine is None:
            raise ValueError(f"state[{key!r}] is not an optimizer set up with a model of this Fabric. Allowed: the "
                             "optimizers returned by fabric.setup(model, optimizer, ...).")
        return engine, next(k for k, opt in enumerate(engine.optimizers) if opt is optimizer)

    # -- save -------------------------------------------------------------------------------------------
    def save(self, path, state: dict, storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        if storage_options is not None or filter:
            raise ValueError("ZeroFabricStrategy writes sharded checkpoint directories, every tensor from every "
                             "rank: fabric.save(..., filter=...) and storage_options are not supported. Allowed: "
                             "fabric.save(path, state); consolidate afterwards with `lightning-zero consolidate`.")
        modules, optimizers, others = self._split_state(state)
        if not modules:
            raise ValueError("fabric.save under ZeroFabricStrategy needs the model in the state (the directory is "
                             "written from its shards), e.g. fabric.save(path, {'model': model, 'optimizer': opt}).")
        saved = self._saved_models(modules, optimizers)
        meta = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in others.items()}
        added = [k for k, v in (("pytorch-lightning_version", lightning.__version__), ("lr_schedulers", []))
                 if meta.setdefault(k, v) is v]
        if _PRECISION_KEY not in meta:
            meta[_PRECISION_KEY] = self.host.precision.state_dict()
            added.append(_PRECISION_KEY)
        path = Path(self.host.broadcast(str(path)))
        if len(saved) > 1 and self.trainable_only_base is not None:
            raise ValueError(f"checkpoint_trainable_only=True saves one model per fabric.save; this state holds "
                             f"{len(saved)} ({', '.join(m.key for m in saved)}). Allowed: one model (with its "
                             "optimizers) per fabric.save, or checkpoint_trainable_only=False.")
        saver = self.saver
        if saver is not None and not any(m.engine is not None for m in saved):
            saver.wait()  # nothing set up (no later step to report a failure at): written now, as a sync save
            saver = None
        if len(saved) > 1:  # one directory per model inside one atomic directory (checkpoint/models_dir.py)
            meta[_FABRIC_KEY] = {"added": added}
            save_models_checkpoint(path, saved, meta, barrier=self.host.barrier, saver=saver)
            return
        (one,) = saved  # one model: the Trainer's own directory, as before
        meta[_FABRIC_KEY] = {"module": one.key, "optimizers": [k for k, _ in one.optimizers], "added": added}
        opt_states = [sharded_optimizer_state(one.engine, opt) for _, opt in one.optimizers] or None
        model_state = sharded_model_state(one.module, one.engine)
        if self.trainable_only_base is not None:
            model_state, meta = trainable_only_state(one.module, one.engine, model_state, self.trainable_only_base, meta)
        if saver is not None:
            save_in_background(saver, path, model_state, one.module, one.engine, opt_states, meta)
        else:
            save_checkpoint_dir(path, model_state, one.module, one.engine, opt_states, meta, barrier=self.host.barrier)

    def _saved_models(self, modules, optimizers) -> list[SavedModel]:
        """Each model of the state with its optimizers (all of them, in the engine's order, or none)."""
        owner = {k: self._optimizer_engine(opt, k) for k, opt in optimizers}
        saved, claimed = [], set()
        for key, module in modules:
            engine = self._engine_of(module)
            mine = sorted(((k, opt) for k, opt in optimizers if engine is not None and owner[k][0] is engine),
                          key=lambda kv: owner[kv[0]][1])
            if mine and len(mine) != len(engine.optimizers):
                raise ValueError(f"The state holds {len(mine)} of the {len(engine.optimizers)} optimizers of "
                                 f"state[{key!r}]. Allowed: all of them (one checkpoint restores them together) "
                                 "or none.")
            claimed.update(k for k, _ in mine)
            saved.append(SavedModel(key, module, engine, mine))
        stray = [k for k, _ in optimizers if k not in claimed]
        if stray:
            raise ValueError(f"state[{stray[0]!r}] is the optimizer of a model that is not in the state. Allowed: "
                             "each optimizer saved with its model, e.g. {'g': g, 'd': d, 'opt_g': opt_g, 'opt_d': "
                             "opt_d}.")
        return saved

    # -- load -------------------------------------------------------------------------------------------
    def load(self, path, state=None, strict: bool = True, weights_only: Optional[bool] = None) -> dict:
        # a URL: a local copy, one download per host ([Note: checkpoints at fsspec locations])
        path = resolve_checkpoint_dir(fetch_checkpoint(self.host.broadcast(str(path)), collective=True))
        if not path.is_dir():
            return self._load_file(path, state, strict, weights_only)
        trust = trusted(self.trust_checkpoint, weights_only)
        if is_models_checkpoint(path):
            return self._load_models(path, state, strict, trust)
        if not state:  # the whole checkpoint, consolidated (full fp32 weights), under the saved names
            full = load_as_lightning_checkpoint(path, trust_checkpoint=trust)
            names = full.pop(_FABRIC_KEY, None) or {}
            for k in names.get("added", []):
                full.pop(k, None)
            if "module" in names:
                full[names["module"]] = full.pop("state_dict")
                full.update(zip(names["optimizers"], full.pop("optimizer_states", None) or []))
            return full
        info = read_info(path, trust)
        meta = read_meta(path, trust_checkpoint=trust)
        names = meta.pop(_FABRIC_KEY, None) or {}
        precision_state = meta.pop(_PRECISION_KEY, None)
        opt_meta = meta.pop("optimizer_states", None) or []
        for k in names.get("added", []):
            meta.pop(k, None)

        def load_module(module, _key):
            load_model_state(path, module, self._engine_of(module), strict, info, trust_checkpoint=trust)

        def load_optimizer(opt, key):
            engine, index = self._optimizer_engine(opt, key)
            if index >= len(opt_meta):
                if strict:
                    raise KeyError(f"Checkpoint {str(path)!r} holds no state for optimizer {index} (state[{key!r}]):"
                                   " it was saved without it. Load with strict=False to skip it.")
                return
            load_optimizer_state(path, engine, opt_meta[index], info, index=index, trust_checkpoint=trust)

        if isinstance(state, Module):  # fabric.load_raw(dir, model)
            load_module(state, None)
            return {}
        if isinstance(state, Optimizer):
            load_optimizer(state, "optimizer")
            return {}
        modules = [k for k, v in state.items() if isinstance(v, Module)]
        # one model requested: the checkpoint's one model, whatever its key (a Trainer's has none); several:
        # by key, the others are not in this checkpoint
        holds = lambda k: (len(modules) == 1 or k == names.get("module")) if k in modules else True  # noqa: E731
        remainder = self._restore(state, meta, strict, load_module, load_optimizer, holds)
        if precision_state is not None:
            self.host.precision.load_state_dict(precision_state)
        return remainder

    def _load_models(self, path: Path, state, strict: bool, trust: bool) -> dict:
        """A directory of several models (checkpoint/models_dir.py): each model and optimizer from its model's
        directory, resharded; the other entries from the top ``meta.pt``."""
        manifest = read_models_manifest(path)
        models = manifest["models"]
        meta = read_meta(path, trust_checkpoint=trust)
        names = meta.pop(_FABRIC_KEY, None) or {}
        precision_state = meta.pop(_PRECISION_KEY, None) if state else None
        for k in names.get("added", []):
            meta.pop(k, None)
        if not state:  # everything, consolidated: each model's full state dict and optimizers under their keys
            for key, entry in models.items():
                full = load_as_lightning_checkpoint(model_checkpoint(path, manifest, key, trust)[0],
                                                    trust_checkpoint=trust)
                meta[key] = full["state_dict"]
                meta.update(zip(entry["optimizers"], full.get("optimizer_states") or []))
            return meta
        if isinstance(state, (Module, Optimizer)):
            raise ValueError(f"Checkpoint {str(path)!r} holds {len(models)} models ({', '.join(models)}). Allowed: "
                             f"fabric.load(path, {{{', '.join(repr(k) + ': ...' for k in models)}}}).")
        saved_opts = {k: (mk, i) for mk, entry in models.items() for i, k in enumerate(entry["optimizers"])}

        def load_module(module, key):
            sub, info = model_checkpoint(path, manifest, key, trust)
            load_model_state(sub, module, self._engine_of(module), strict, info, trust_checkpoint=trust)

        def load_optimizer(opt, key):
            engine, index = self._optimizer_engine(opt, key)
            model_key, saved_index = saved_opts[key]
            if index != saved_index:
                raise ValueError(f"state[{key!r}] is optimizer {index} of its model; it was saved as optimizer "
                                 f"{saved_index} of state[{model_key!r}]. Allowed: set up each model's optimizers "
                                 "in the order they were saved.")
            sub, info = model_checkpoint(path, manifest, model_key, trust)
            opt_meta = read_meta(sub, trust_checkpoint=trust).get("optimizer_states") or []
            if saved_index >= len(opt_meta):
                raise ValueError(f"Corrupt checkpoint {str(sub)!r}: its {META_FILE} holds no param groups for "
                                 f"optimizer {saved_index} (state[{key!r}]).")
            load_optimizer_state(sub, engine, opt_meta[saved_index], info, index=saved_index, trust_checkpoint=trust)

        remainder = self._restore(state, meta, strict, load_module, load_optimizer,
                                  lambda k: k in models or k in saved_opts)
        if precision_state is not None:
            self.host.precision.load_state_dict(precision_state)
        return remainder

    def _load_file(self, path: Path, state, strict: bool, weights_only: Optional[bool]) -> dict:
        """A single file (Fabric's DDP, ``torch.save``): full tensors, into the engines' masters and shards."""
        checkpoint = self.host.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        if not state:
            return checkpoint

        def load_module(module, key):
            sd = checkpoint if key is None else checkpoint.pop(key)
            engine = self._engine_of(module)
            (engine.load_full_state_dict if engine is not None else module.load_state_dict)(sd, strict=strict)

        def load_optimizer(opt, key):
            engine, _ = self._optimizer_engine(opt, key)
            engine.load_optimizer_state_dict(checkpoint if key is None else checkpoint.pop(key), opt)

        if isinstance(state, Module):
            load_module(state, None)
            return {}
        if isinstance(state, Optimizer):
            load_optimizer(state, None)
            return {}
        return self._restore(state, checkpoint, strict, load_module, load_optimizer, lambda k: k in checkpoint)

    def _restore(self, state: dict, checkpoint: dict, strict: bool, load_module, load_optimizer,
                 holds: Callable[[str], bool]) -> dict:
        """Fabric's rules (``Strategy.load_checkpoint``): every requested entry must exist when ``strict``,
        objects are restored in place, plain values replaced in ``state``; what is left is returned.
        ``holds(key)``: whether the checkpoint has that model or optimizer."""
        modules, optimizers, others = self._split_state(state)
        missing = [k for k in others if k not in checkpoint] + [k for k, _ in modules + optimizers if not holds(k)]
        if strict and missing:
            raise KeyError(f"The requested state contains a key {missing[0]!r} that does not exist in the loaded "
                           "checkpoint. To disable strict loading, set `strict=False`.")
        for key, module in modules:
            if holds(key):
                load_module(module, key)
        for key, opt in optimizers:
            if holds(key):
                load_optimizer(opt, key)
        for key, obj in others.items():
            if key not in checkpoint:
                continue
            if isinstance(obj, Stateful):
                obj.load_state_dict(checkpoint.pop(key))
            else:
                state[key] = checkpoint.pop(key)
        return checkpoint
