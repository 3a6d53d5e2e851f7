"""Lightning glue for engine-managed optimizers: LightningOptimizer, toggle_optimizer, BaseFinetuning.

Design note
-----------
The engine keeps the user's optimizer objects but their param groups hold *master shards*, not the
module's parameters. Lightning code that thinks in module parameters is pointed at the engine's view
of each group (``ShardedOptimizer.group_params``):

* ``LightningOptimizer`` (what ``self.optimizers()`` returns) subclasses the optimizer's class, so its
  ``zero_grad`` / ``add_param_group`` would be torch's: the engine gives the optimizer object a routed class
  of its own while it manages it (engine/optim/optimizer_routes.py), which every wrapper, however late Lightning
  rebuilds it, finds first in its MRO. Nothing here touches Lightning's classes.
* ``LightningModule.toggle_optimizer`` / ``untoggle_optimizer`` flip ``requires_grad`` of the module
  parameters of the other optimizers (Lightning's own would flip the masters', which autograd never sees).
* ``BaseFinetuning`` maps the optimizer's parameters back to module names and filters new parameters
  against the optimizer's by value (``torch.equal``, which reads released stage-3 storage): its
  bookkeeping is given module parameters, and ``unfreeze_and_add_param_group`` filters by identity.
"""

from __future__ import annotations

from typing import Any, Callable

from lightning.pytorch.callbacks.finetuning import BaseFinetuning
from lightning.pytorch.core.optimizer import LightningOptimizer

from .compat import finetuning_state


def raw_optimizer(optimizer):
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def bind(strategy, trainer) -> Callable[[], None]:
    """Install the glue after the engine exists; returns the undo for teardown."""
    engine, module = strategy.engine, strategy.lightning_module
    undo: list[Callable[[], None]] = []

    def module_params(opt) -> list:
        return [p for g in engine.sharded_for(raw_optimizer(opt)).group_params for p in g]

    def toggle_optimizer(optimizer) -> None:  # Lightning's rule, on module parameters
        state: dict[int, tuple[Any, bool]] = {}
        for opt in engine.optimizers:
            for p in module_params(opt):
                if id(p) not in state:
                    state[id(p)] = (p, p.requires_grad)
                    p.requires_grad = False
        for p in module_params(optimizer):
            p.requires_grad = state[id(p)][1]
        module._param_requires_grad_state = state

    def untoggle_optimizer(optimizer) -> None:
        state = getattr(module, "_param_requires_grad_state", {}) or {}
        for opt in engine.optimizers:
            if opt is not raw_optimizer(optimizer):
                for p in module_params(opt):
                    if id(p) in state:
                        p.requires_grad = state[id(p)][1]
        module._param_requires_grad_state = {}

    module.toggle_optimizer, module.untoggle_optimizer = toggle_optimizer, untoggle_optimizer
    undo.append(lambda: [module.__dict__.pop(n, None) for n in ("toggle_optimizer", "untoggle_optimizer")])

    for cb in trainer.callbacks:
        if isinstance(cb, BaseFinetuning):
            undo.append(_bind_finetuning(cb, engine))
    return lambda: [u() for u in undo]


def _bind_finetuning(cb: BaseFinetuning, engine) -> Callable[[], None]:
    store, _, _ = finetuning_state(cb)  # through compat: BaseFinetuning's private bookkeeping

    def _store(pl_module, opt_idx, num_param_groups, current_param_groups):
        opt = engine.optimizers[opt_idx]
        groups = [{**g, "params": ps} for g, ps in zip(opt.param_groups, engine.sharded_for(opt).group_params)]
        return store(pl_module, opt_idx, num_param_groups, groups)

    def unfreeze_and_add_param_group(modules, optimizer, lr=None, initial_denom_lr: float = 10.0,
                                     train_bn: bool = True) -> None:
        optimizer = raw_optimizer(optimizer)
        BaseFinetuning.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom_lr = initial_denom_lr if lr is None else 1.0
        held = {id(p) for g in engine.sharded_for(optimizer).group_params for p in g}
        params = [p for p in BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True)
                  if id(p) not in held]
        if params:
            optimizer.add_param_group({"params": params, "lr": params_lr / denom_lr})

    def on_fit_start(trainer, pl_module) -> None:
        # Lightning reassigns ``optimizer.param_groups`` (module parameters) when restarting; add the groups
        # the checkpoint's run had created instead, so they get masters
        _, restarting, metadata = finetuning_state(cb)
        if restarting:
            named = dict(pl_module.named_parameters())
            for opt_idx, opt in enumerate(engine.optimizers):
                for g in metadata.get(opt_idx, [])[len(opt.param_groups):]:
                    opt.add_param_group({**{k: v for k, v in g.items() if k != "params"},
                                         "params": [named[n] for n in g["params"]]})
            cb._restarting = False

    names = ("_store", "unfreeze_and_add_param_group", "on_fit_start")
    cb._store, cb.unfreeze_and_add_param_group, cb.on_fit_start = _store, unfreeze_and_add_param_group, on_fit_start
    return lambda: [cb.__dict__.pop(n, None) for n in names]
