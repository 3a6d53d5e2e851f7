"""The user's optimizer object while an engine manages it: ``zero_grad`` / ``add_param_group`` routed to the
engine ([Note: routed optimizer methods])."""

from __future__ import annotations

# [Note: routed optimizer methods]
# ``zero_grad`` / ``add_param_group`` of a managed optimizer must reach the engine: torch's would clear only
# the masters' ``.grad`` while the reduced gradient shards of that optimizer's buckets live on (a GAN's
# ``opt_d.zero_grad()`` would keep what the generator's backward left for the discriminator), or add module
# parameters next to masters. Lightning's ``LightningOptimizer`` and Fabric's ``_FabricOptimizer`` wrap the
# optimizer in a class built as ``(Wrapper, type(optimizer))``, so a method on the *instance* is never seen
# through a wrapper (the MRO finds torch's first), and the wrappers are rebuilt whenever a strategy's
# ``optimizers`` is assigned. So the engine gives the optimizer object a class of its own for as long as it
# manages it: ``Routed<cls>`` (same name), whose two methods look the engine's route up by attribute -- through
# a wrapper that lookup reaches the wrapped optimizer (both wrappers delegate unknown attributes) -- and are
# torch's own once the engine let go. No class of Lightning or Fabric is touched; every wrapper built at any
# time after setup routes, and other strategies' optimizers keep their class.
_ROUTE = "_lightning_zero_route"
_ROUTED: dict[type, type] = {}  # the user's optimizer class -> its routed subclass (one per class)


class _Route:
    """The engine's methods for one optimizer object; ``state_view(optimizer)``: a context in which torch's
    ``state_dict`` / ``load_state_dict`` see this rank's part (an owner-rank step's groups hold whole masters
    there, the tensors its state is keyed on: torch's own would not find them in the groups)."""

    def __init__(self, optimizer, add_param_group, zero_grad, state_view=None) -> None:
        self.optimizer, self.add_param_group, self.zero_grad = optimizer, add_param_group, zero_grad
        self.state_view = state_view


class _RoutedMethods:
    def zero_grad(self, set_to_none: bool = True) -> None:
        route = getattr(self, _ROUTE, None)
        if route is None:  # the engine let go (a wrapper built while it managed this optimizer)
            return super().zero_grad(set_to_none)
        return route.zero_grad(route.optimizer, set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        route = getattr(self, _ROUTE, None)
        if route is None:
            return super().add_param_group(param_group)
        return route.add_param_group(route.optimizer, param_group)


    def state_dict(self):
        route = getattr(self, _ROUTE, None)
        if route is None or route.state_view is None:
            return super().state_dict()
        with route.state_view(route.optimizer):
            return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        route = getattr(self, _ROUTE, None)
        if route is None or route.state_view is None:
            return super().load_state_dict(state_dict)
        with route.state_view(route.optimizer):
            return super().load_state_dict(state_dict)


def routed_class(cls: type) -> type:
    if cls not in _ROUTED:
        _ROUTED[cls] = type(cls.__name__, (_RoutedMethods, cls),
                            {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "_zero_user_class": cls})
    return _ROUTED[cls]


def user_class(optimizer) -> type:
    """The optimizer's own class, routed or not (its torch methods, e.g. ``add_param_group`` on masters)."""
    return type(optimizer).__dict__.get("_zero_user_class", type(optimizer))


def install_optimizer_methods(optimizers, add_param_group, zero_grad, state_view=None) -> None:
    """Route each managed optimizer's ``add_param_group`` and ``zero_grad`` to the engine's
    ([Note: routed optimizer methods]), and its ``state_dict`` / ``load_state_dict`` through ``state_view``."""
    for opt in optimizers:
        setattr(opt, _ROUTE, _Route(opt, add_param_group, zero_grad, state_view))
        opt.__class__ = routed_class(user_class(opt))


def remove_optimizer_methods(optimizers) -> None:
    for opt in optimizers:
        opt.__dict__.pop(_ROUTE, None)
        if type(opt) is _ROUTED.get(user_class(opt)):
            opt.__class__ = user_class(opt)
