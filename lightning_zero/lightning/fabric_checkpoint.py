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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import lightning
from lightning.fabric.utilities.types import _Stateful
from torch.nn import Module
from torch.optim import Optimizer

from ..checkpoint.format import (load_model_state, load_optimizer_state, read_info, read_meta,
                                 resolve_checkpoint_dir, save_checkpoint_dir, sharded_model_state,
                                 sharded_optimizer_state)
from ..checkpoint.trust import trusted
from .lightning_io import load_as_lightning_checkpoint
from .precision import ZeroPrecision

_FABRIC_KEY = "lightning_zero_fabric"  # which entries were the model / optimizers, which keys were added
_PRECISION_KEY = ZeroPrecision.__qualname__  # where the Trainer keeps (and restores) the plugin's state


class ZeroFabricCheckpointMixin:
    """``save_checkpoint`` / ``load_checkpoint`` of :class:`ZeroFabricStrategy` (expects ``self.engine``)."""

    def _split_state(self, state: dict) -> tuple[Optional[tuple[str, Module]], list[tuple[str, Optimizer]], dict]:
        modules = [(k, v) for k, v in state.items() if isinstance(v, Module)]
        optimizers = [(k, v) for k, v in state.items() if isinstance(v, Optimizer)]
        if len(modules) > 1:
            raise ValueError(f"ZeroFabricStrategy checkpoints hold one model; the state has {len(modules)} "
                             f"({', '.join(k for k, _ in modules)}). Allowed: one nn.Module entry.")
        others = {k: v for k, v in state.items() if not isinstance(v, (Module, Optimizer))}
        return (modules[0] if modules else None), optimizers, others

    def _engine_of(self, module: Module):
        engine = getattr(self, "engine", None)
        return engine if engine is not None and engine.module is module else None

    def _optimizer_index(self, engine, optimizer: Optimizer, key: str) -> int:
        for k, opt in enumerate(engine.optimizers if engine is not None and engine.sharded is not None else []):
            if opt is optimizer:
                return k
        raise ValueError(f"state[{key!r}] is not an optimizer set up with this model. Allowed: the optimizers "
                         "returned by fabric.setup(model, optimizer, ...).")

    # -- save -------------------------------------------------------------------------------------------
    def save_checkpoint(self, path, state: dict, storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        if storage_options is not None or filter:
            raise ValueError("ZeroFabricStrategy writes sharded checkpoint directories, every tensor from every "
                             "rank: fabric.save(..., filter=...) and storage_options are not supported. Allowed: "
                             "fabric.save(path, state); consolidate afterwards with `lightning-zero consolidate`.")
        model, optimizers, others = self._split_state(state)
        if model is None:
            raise ValueError("fabric.save under ZeroFabricStrategy needs the model in the state (the directory is "
                             "written from its shards), e.g. fabric.save(path, {'model': model, 'optimizer': opt}).")
        key, module = model
        engine = self._engine_of(module)
        order = sorted(optimizers, key=lambda kv: self._optimizer_index(engine, kv[1], kv[0]))
        if order and len(order) != len(engine.optimizers):
            raise ValueError(f"The state holds {len(order)} of the model's {len(engine.optimizers)} optimizers. "
                             "Allowed: all of them (one checkpoint restores them together) or none.")
        meta = {k: (v.state_dict() if isinstance(v, _Stateful) else v) for k, v in others.items()}
        added = [k for k, v in (("pytorch-lightning_version", lightning.__version__), ("lr_schedulers", []))
                 if meta.setdefault(k, v) is v]
        if _PRECISION_KEY not in meta:
            meta[_PRECISION_KEY] = self.precision.state_dict()
            added.append(_PRECISION_KEY)
        meta[_FABRIC_KEY] = {"module": key, "optimizers": [k for k, _ in order], "added": added}
        opt_states = [sharded_optimizer_state(engine, opt) for _, opt in order] or None
        save_checkpoint_dir(Path(self.broadcast(str(path))), sharded_model_state(module, engine), module, engine,
                            opt_states, meta, barrier=self.barrier)

    # -- load -------------------------------------------------------------------------------------------
    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: Optional[bool] = None) -> dict:
        path = resolve_checkpoint_dir(self.broadcast(str(path)))
        if not path.is_dir():
            return self._load_file(path, state, strict, weights_only)
        trust = trusted(getattr(self, "trust_checkpoint", False), weights_only)
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

        def load_optimizer(opt, key, module):
            engine = self._engine_of(module) if module is not None else getattr(self, "engine", None)
            index = self._optimizer_index(engine, opt, key)
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
            load_optimizer(state, "optimizer", None)
            return {}
        remainder = self._restore(state, meta, strict, load_module, load_optimizer)
        if precision_state is not None:
            self.precision.load_state_dict(precision_state)
        return remainder

    def _load_file(self, path: Path, state, strict: bool, weights_only: Optional[bool]) -> dict:
        """A single file (Fabric's DDP, ``torch.save``): full tensors, into the engine's masters and shards."""
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        if not state:
            return checkpoint

        def load_module(module, key):
            sd = checkpoint if key is None else checkpoint.pop(key)
            engine = self._engine_of(module)
            (engine.load_full_state_dict if engine is not None else module.load_state_dict)(sd, strict=strict)

        def load_optimizer(opt, key, module):
            engine = self._engine_of(module) if module is not None else getattr(self, "engine", None)
            self._optimizer_index(engine, opt, key)
            engine.load_optimizer_state_dict(checkpoint if key is None else checkpoint.pop(key), opt)

        if isinstance(state, Module):
            load_module(state, None)
            return {}
        if isinstance(state, Optimizer):
            load_optimizer(state, None, None)
            return {}
        return self._restore(state, checkpoint, strict, load_module, load_optimizer, modules_in_checkpoint=False)

    def _restore(self, state: dict, checkpoint: dict, strict: bool, load_module, load_optimizer,
                 modules_in_checkpoint: bool = True) -> dict:
        """Fabric's rules (``Strategy.load_checkpoint``): every requested entry must exist when ``strict``,
        objects are restored in place, plain values replaced in ``state``; what is left is returned."""
        model, optimizers, others = self._split_state(state)
        keyed = [] if modules_in_checkpoint else [k for k, _ in ([model] if model else []) + optimizers]
        missing = [k for k in list(others) + keyed if k not in checkpoint]
        if strict and missing:
            raise KeyError(f"The requested state contains a key {missing[0]!r} that does not exist in the loaded "
                           "checkpoint. To disable strict loading, set `strict=False`.")
        if model is not None and (modules_in_checkpoint or model[0] in checkpoint):
            load_module(model[1], model[0])
        for key, opt in optimizers:
            if modules_in_checkpoint or key in checkpoint:
                load_optimizer(opt, key, model[1] if model is not None else None)
        for key, obj in others.items():
            if key not in checkpoint:
                continue
            if isinstance(obj, _Stateful):
                obj.load_state_dict(checkpoint.pop(key))
            else:
                state[key] = checkpoint.pop(key)
        return checkpoint
