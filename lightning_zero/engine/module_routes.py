"""The module an engine trains: ``zero_grad`` on it or on any of its submodules reaches the engine
([Note: routed module zero_grad])."""

from __future__ import annotations

import weakref

import torch.jit
from torch import nn

# [Note: routed module zero_grad]
# ``self.zero_grad()`` in a LightningModule, ``model.zero_grad()`` on a plain module and a submodule's
# ``self.disc.zero_grad()`` (the DCGAN idiom) are ``nn.Module.zero_grad``: it sets ``param.grad`` only,
# while at stages 1-3 a backward's gradients live in the engine's reduced shards ([Note: clearing reduced
# gradients], grad_clear.py). torch has no hook for it, and the call is on the user's own objects (Lightning
# itself calls ``lightning_module.zero_grad()`` before a stage and ``on_validation_model_zero_grad``), so
# the engine gives every module of its tree that holds parameters a class of its own while it trains them:
# ``Routed<cls>`` (same name, a subclass, so ``isinstance`` and Lightning's hook lookup see the user's
# class), whose ``zero_grad`` runs the module's own and then hands its parameters to the engine. The route
# is kept in a weak table, not on the module, and a routed module pickles and deep-copies as its own class:
# a copy is not trained by the engine and clears its own ``.grad`` only. The class is restored when the
# engine lets go, as the optimizer's (optimizer_routes.py).
_ROUTES: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()
_ROUTED: dict[type, type] = {}  # the module's class -> its routed subclass (one per class)


class _RoutedZeroGrad:
    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # every parameter's .grad, managed or not, as torch does
        route = _ROUTES.get(self)
        if route is not None:
            route(list(self.parameters()), set_to_none)

    def __reduce_ex__(self, protocol):
        # pickle and copy.deepcopy rebuild the user's class: the copy is no module this engine trains
        fn, args, *rest = super().__reduce_ex__(protocol)
        if args and args[0] is type(self):  # copyreg.__newobj__(cls, ...); pickle insists on type(self) there
            fn, args = _new_plain, (type(self).__dict__["_zero_user_class"],) + tuple(args[1:])
        return (fn, args, *rest)


def _new_plain(cls: type, *args):
    return cls.__new__(cls, *args)


def _routed_class(cls: type) -> type:
    if cls not in _ROUTED:
        _ROUTED[cls] = type(cls.__name__, (_RoutedZeroGrad, cls),
                            {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "_zero_user_class": cls})
    return _ROUTED[cls]


def _user_class(module: nn.Module) -> type:
    return type(module).__dict__.get("_zero_user_class", type(module))


def install_module_zero_grad(root: nn.Module, zero_grad_params) -> None:
    """``zero_grad(set_to_none)`` of ``root`` and of each submodule holding parameters calls
    ``zero_grad_params(its parameters, set_to_none)`` after torch's ([Note: routed module zero_grad])."""
    for m in root.modules():
        # TorchScript's modules keep their class (it cannot change); the routed zero_grad calls the
        # module's own first, so a class overriding it keeps what it does
        if next(m.parameters(), None) is not None and not isinstance(m, torch.jit.ScriptModule):
            _ROUTES[m] = zero_grad_params
            m.__class__ = _routed_class(_user_class(m))


def remove_module_zero_grad(root: nn.Module) -> None:
    for m in root.modules():
        if _ROUTES.pop(m, None) is not None and type(m) is _ROUTED.get(_user_class(m)):
            m.__class__ = _user_class(m)
