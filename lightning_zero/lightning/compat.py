"""Every private Lightning / torch name the Lightning layer and the tools rely on, in one place.

Design note
-----------
Lightning's and torch's underscored names carry no compatibility promise: a release may rename or move
one. The adapter reaches them through :func:`private` / :func:`private_attr`, which fail with
:class:`PrivateAPIMoved` naming the name and the installed Lightning and torch versions -- never a
``getattr(..., default)`` that would turn a rename into silently different behaviour (e.g. the
evaluation join of stage 3, which reads the active loop's batch progress). Three kinds are only listed,
not wrapped, because a move already fails loudly where they are used: the protected ``DDPStrategy``
members the strategies override or call (``_configure_launcher``, ``_setup_distributed``, ...), the
class attributes ``lightning_io.py``'s import-time wrap and ``model_summary.py``'s per-fit binding read, and the
names outside this layer (the engine's torch privates, :data:`TORCH_CANARIES`: ``engine/`` imports nothing
from here; the transformers tables of ``tools/export_hf.py``). ``tests/test_compat_canaries.py`` resolves
every entry of :data:`CANARIES` and the other tables, and the instance attributes (Fabric's wrappers', a
LightningModule's, a callback's) on real objects it builds, so an upgrade that moves one fails there first,
with the same message.
"""

from __future__ import annotations

import importlib
from typing import Any


class PrivateAPIMoved(RuntimeError):
    """A private Lightning / torch name this package relies on is gone from the installed version."""


def _versions() -> str:
    import torch

    try:
        import lightning

        return f"lightning {lightning.__version__}, torch {torch.__version__}"
    except ImportError:  # pragma: no cover - the Lightning layer always has Lightning
        return f"torch {torch.__version__}"


def moved(name: str, detail: str = "") -> PrivateAPIMoved:
    return PrivateAPIMoved(f"lightning_zero relies on the private name {name}, which the installed versions "
                           f"({_versions()}) do not have{': ' + detail if detail else ''}. lightning_zero.lightning."
                           f"compat lists every such name; pin the versions it was tested with or update it.")


def private(module: str, name: str) -> Any:
    """``module.name`` (a dotted ``name`` walks attributes), or one clear error naming it and the versions."""
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as e:
        raise moved(f"{module}.{name}", f"module {module} does not import ({e})") from e
    for part in name.split("."):
        if part not in _names(obj):
            raise moved(f"{module}.{name}")
        obj = getattr(obj, part)
    return obj


def _names(obj: Any) -> set:
    return set(dir(obj))


def private_attr(obj: Any, name: str, owner: str) -> Any:
    """``obj.name`` of a live object (an instance attribute Lightning sets privately); ``owner`` names its
    class in the error."""
    try:
        return getattr(obj, name)
    except AttributeError as e:
        raise moved(f"{owner}.{name}") from e


# -- the names, resolved once at import (a move fails `import lightning_zero.lightning`, loudly) -----------
_PL = "lightning.pytorch"
_FABRIC = "lightning.fabric"

sync_module_states = private(f"{_PL}.strategies.ddp", "_sync_module_states")
SubprocessScriptLauncher = private(f"{_PL}.strategies.launchers", "_SubprocessScriptLauncher")
MultiProcessingLauncher = private(f"{_PL}.strategies.launchers", "_MultiProcessingLauncher")
FabricSubprocessScriptLauncher = private(f"{_FABRIC}.strategies.launchers.subprocess_script",
                                         "_SubprocessScriptLauncher")
BackwardSyncControl = private(f"{_FABRIC}.strategies.strategy", "_BackwardSyncControl")
Stateful = private(f"{_FABRIC}.utilities.types", "_Stateful")
TunerExitException = private(f"{_PL}.utilities.exceptions", "_TunerExitException")


def fabric_module_wrapper() -> type:
    """Fabric's ``_FabricModule`` (its ``zero_grad`` is completed in fabric_strategy.py)."""
    return private(f"{_FABRIC}.wrappers", "_FabricModule")


def fabric_optimizer_wrapper() -> type:
    """Fabric's ``_FabricOptimizer``, what ``fabric.setup`` returns for an optimizer."""
    return private(f"{_FABRIC}.wrappers", "_FabricOptimizer")


def batch_size_scaling() -> Any:
    """Lightning's batch-size search module, whose loop helpers ZeroBatchSizeFinder reuses (checked here)."""
    module = importlib.import_module(f"{_PL}.tuner.batch_size_scaling")
    for name in _SCALING_NAMES:
        private(module.__name__, name)
    return module


_SCALING_NAMES = ("__scale_batch_dump_params", "__scale_batch_reset_params", "__scale_batch_restore_params",
                  "_reset_dataloaders", "_reset_progress", "_try_loop_run")


def tuning_module() -> Any:
    """``lightning.pytorch.tuner.tuning``, with its ``_check_scale_batch_size_configuration``."""
    private(f"{_PL}.tuner.tuning", "_check_scale_batch_size_configuration")
    return importlib.import_module(f"{_PL}.tuner.tuning")


# -- live objects ---------------------------------------------------------------------------------------------
def is_last_batch(trainer: Any) -> bool:
    """Whether the loop running now (validate / test / predict) is at its last batch: the stage-3 join's cue.
    A trainer-less call (a module stepped by hand) has no loop: False."""
    if trainer is None:
        return False
    loop = private_attr(trainer, "_active_loop", "Trainer")
    if loop is None or loop is trainer.fit_loop:  # not evaluating (the fit loop's batches are training's)
        return False
    progress = private_attr(loop, "batch_progress", type(loop).__name__)
    return bool(private_attr(progress, "is_last_batch", type(progress).__name__))


def module_trainer(module: Any) -> Any:
    """The LightningModule's trainer, or None before it has one (``module.trainer`` raises then)."""
    return private_attr(module, "_trainer", "LightningModule")


def set_module_device_mesh(module: Any, mesh: Any) -> None:
    """``LightningModule.device_mesh`` in ``configure_model``, as Lightning's ModelParallelStrategy sets it."""
    private_attr(module, "_device_mesh", "LightningModule")
    module._device_mesh = mesh


def wrap_rank_zero_results(launcher: Any, wrap: Any) -> None:
    """Replace a fork/spawn launcher's ``_collect_rank_zero_results(trainer, results)`` by
    ``wrap(original)(trainer, results)`` (the script launcher has none and is left alone)."""
    if not isinstance(launcher, MultiProcessingLauncher):
        return
    original = private_attr(launcher, "_collect_rank_zero_results", type(launcher).__name__)
    launcher._collect_rank_zero_results = wrap(original)


def fabric_forward_module(module: Any) -> Any:
    """The module a ``_FabricModule`` runs (its ``_forward_module``: what the strategy's ``setup_module``
    returned); any other module as it is."""
    if not isinstance(module, fabric_module_wrapper()):
        return module
    return private_attr(module, "_forward_module", "_FabricModule")


def fabric_module_strategy(module: Any) -> Any:
    """The strategy a ``_FabricModule`` was set up under (its ``_strategy``). Read from the wrapper's own
    ``__dict__``: the wrapper's attribute lookup falls through to the user's module, whose ``_strategy``
    (if it had one) is not Fabric's."""
    own = vars(module)
    if "_strategy" not in own:
        raise moved("_FabricModule._strategy")
    return own["_strategy"]


def fabric_optimizer(optimizer: Any) -> Any:
    """The optimizer a ``_FabricOptimizer`` wraps (its public ``optimizer``); any other optimizer as it is."""
    return optimizer.optimizer if isinstance(optimizer, fabric_optimizer_wrapper()) else optimizer


def toggled_requires_grad(module: Any) -> dict:
    """The ``requires_grad`` flags ``toggle_optimizer`` saved on a LightningModule (its
    ``_param_requires_grad_state``, which ``untoggle_optimizer`` restores from)."""
    return private_attr(module, "_param_requires_grad_state", "LightningModule") or {}


def summary_max_depth(cb: Any) -> int:
    """A ``ModelSummary`` callback's ``max_depth`` (its ``_max_depth``)."""
    return private_attr(cb, "_max_depth", "ModelSummary")


def finetuning_state(cb: Any) -> tuple[Any, bool, dict]:
    """A ``BaseFinetuning``'s ``_store`` method, ``_restarting`` flag and ``_internal_optimizer_metadata``."""
    return (private_attr(cb, "_store", "BaseFinetuning"), private_attr(cb, "_restarting", "BaseFinetuning"),
            private_attr(cb, "_internal_optimizer_metadata", "BaseFinetuning"))


def fit_data_is_module(trainer: Any) -> bool:
    """Whether the fit's data comes from the LightningModule's own dataloader hooks."""
    return private_attr(trainer.fit_loop, "_data_source", "_FitLoop").is_module()


def restore_checkpoint(trainer: Any, ckpt_path: str) -> None:
    private_attr(trainer, "_checkpoint_connector", "Trainer").restore(ckpt_path)


def fit_dataset_length(loop: Any) -> int:
    """The fit loop's combined loader's length (raises NotImplementedError / TypeError for iterable data)."""
    return int(private_attr(loop, "_combined_loader", "_FitLoop")._dataset_length())


# -- what the canary test resolves ------------------------------------------------------------------------------
#: (module, dotted name) of every private name above, plus those reached by lightning_io.py / model_summary.py
CANARIES: tuple[tuple[str, str], ...] = (
    (f"{_PL}.strategies.ddp", "_sync_module_states"),
    (f"{_PL}.strategies.launchers", "_SubprocessScriptLauncher"),
    (f"{_PL}.strategies.launchers", "_MultiProcessingLauncher"),
    (f"{_PL}.strategies.launchers", "_MultiProcessingLauncher._collect_rank_zero_results"),
    (f"{_FABRIC}.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"),
    (f"{_FABRIC}.strategies.strategy", "_BackwardSyncControl"),
    (f"{_FABRIC}.utilities.types", "_Stateful"),
    (f"{_FABRIC}.wrappers", "_FabricModule"),
    (f"{_FABRIC}.wrappers", "_FabricOptimizer"),
    (f"{_PL}.utilities.exceptions", "_TunerExitException"),
    (f"{_PL}.tuner.tuning", "_check_scale_batch_size_configuration"),
    *((f"{_PL}.tuner.batch_size_scaling", n) for n in _SCALING_NAMES),
    (f"{_PL}.callbacks", "BaseFinetuning._store"),
    (f"{_PL}.callbacks", "ModelSummary._summary"),
    (f"{_PL}.utilities.model_summary", "ModelSummary._get_summary_data"),
    (f"{_PL}", "Trainer._active_loop"),
    (f"{_PL}.strategies", "DDPStrategy._configure_launcher"),
    (f"{_PL}.strategies", "DDPStrategy._get_process_group_backend"),
    (f"{_FABRIC}.strategies", "DDPStrategy._configure_launcher"),
    (f"{_FABRIC}.strategies", "DDPStrategy._setup_distributed"),
)

#: torch privates the engine reaches itself (engine/layout/groups.py, pipeline.py, tensor_parallel.py, grads/clip_routes.py)
TORCH_CANARIES: tuple[tuple[str, str], ...] = (
    ("torch.distributed.distributed_c10d", "_world"),
    ("torch.distributed.distributed_c10d", "_get_default_group"),
    ("torch.distributed.distributed_c10d", "_hash_ranks_to_str"),
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
    ("torch.utils._pytree", "tree_map"),
    ("torch.nn.utils.clip_grad", "_clip_grads_with_norm_"),  # engine/grads/clip_routes.py: what a bound copy reaches
)

#: transformers privates of tools/export_hf.py (the auto classes' config -> model class tables)
TRANSFORMERS_CANARIES: tuple[tuple[str, str], ...] = tuple(
    ("transformers", f"{auto}._model_mapping")
    for auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM", "AutoModel"))
