"""``ZeroStrategy(tensor_parallel_size=T)``: the 2-D mesh, the data split and the refused combinations.

The strategy builds ``init_device_mesh(device, (N // T, T), mesh_dim_names=("data_parallel",
"tensor_parallel"))`` once the processes exist (``setup_environment``, as Lightning's ModelParallelStrategy
does; made once per process, ``engine/layout/groups.py`` ``tensor_parallel_mesh``) and sets it as ``LightningModule.device_mesh`` before ``configure_model``, where the user cuts the
model with ``parallelize_module(..., self.device_mesh["tensor_parallel"], plan)``. The engine gets the
mesh (``engine/layout/tensor_parallel.py``: ZeRO over the data-parallel dim, norms over both). The sampler splits
by the data-parallel rank only: the T ranks of one tensor-parallel group must see the same batch.
Imports nothing from Lightning.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..engine.layout import tensor_parallel as TP
from ..engine.layout.dims import ParallelDims
from ..engine.layout.groups import tensor_parallel_mesh


class TensorParallelLayout:
    """The (N // T, T) layout of a strategy with ``tensor_parallel_size=T``; the mesh once built."""

    def __init__(self, size: int, shard_group_size: Optional[int] = None) -> None:
        self.size = size
        self.shard_group_size = shard_group_size  # hybrid sharding's K: it splits the N // T data-parallel ranks
        self.mesh: Optional[Any] = None

    @classmethod
    def of(cls, size: Optional[int], config, checkpoint_format: str = "sharded") -> Optional["TensorParallelLayout"]:
        if size is None:  # its type, stages and combinations: ZeroConfig (engine/layout/dims.py's one table)
            return None
        if checkpoint_format != "sharded":  # a full file would need every TP piece gathered into one rank
            raise ValueError(f"checkpoint_format={checkpoint_format!r} is not available with tensor_parallel_size: "
                             "Allowed: checkpoint_format='sharded' (then `lightning-zero consolidate` for one "
                             "full state dict).")
        return cls(size, config.shard_group_size)

    def check_world(self, world_size: int) -> None:
        """T divides the world and K (``shard_group_size``) the N // T data-parallel ranks: one clear error naming
        the allowed sizes, asked before any process starts (the launcher knows N) and again in ``build``."""
        ParallelDims(shard=self.shard_group_size, tensor=self.size).check_world(world_size, ("tensor", "shard"))

    def build(self, world_size: int, device: torch.device) -> Any:
        """The 2-D mesh (collective: every rank calls it, after the process group exists)."""
        self.check_world(world_size)  # before the mesh's collective: every rank raises the same error
        # made once per process (engine/layout/groups.py): a mesh per setup_environment leaked its groups' fds
        self.mesh = tensor_parallel_mesh(device.type, self.size, world_size)
        return self.mesh

    @staticmethod
    def mesh_of(layout: Optional["TensorParallelLayout"]) -> Optional[Any]:
        """The built mesh a strategy hands its engine (None without TP)."""
        return layout.mesh if layout is not None else None

    @staticmethod
    def device_mesh_of(layout: Optional["TensorParallelLayout"], owner: str) -> Any:
        """A strategy's ``device_mesh``: the ("data_parallel", "tensor_parallel") DeviceMesh."""
        if layout is None:
            raise AttributeError(f"{owner}.device_mesh exists with tensor_parallel_size=T only.")
        return layout.device_mesh

    @property
    def device_mesh(self) -> Any:
        if self.mesh is None:
            raise RuntimeError("The device mesh is built once the processes exist (setup_environment); it is "
                               "available from LightningModule.configure_model on (Trainer), after "
                               "fabric.launch() (Fabric).")
        return self.mesh

    def sampler_kwargs(self) -> dict:
        dp = self.device_mesh[TP.DP_DIM]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    @staticmethod
    def whole_results(collect: Any) -> Any:
        """A fork/spawn launcher's ``collect(trainer, results)`` (``compat.wrap_rank_zero_results``) sends the
        trained weights back to the parent process, whose model was never parallelized: there they must be
        whole tensors, not DTensor pieces (which it cannot even unpickle). Gathered on every rank (a
        collective over each TP group), saved by rank 0 as before."""

        def collect_whole(trainer, results):
            module = trainer.lightning_module
            own = module.state_dict
            module.state_dict = lambda *a, **k: {key: TP.full_value(v) for key, v in own(*a, **k).items()}
            try:
                return collect(trainer, results)
            finally:
                del module.state_dict

        return collect_whole

    def sync_module_states(self, module: torch.nn.Module) -> None:
        """Rank 0's values on every data-parallel replica (an evaluation without an engine)."""
        TP.broadcast_module_states(module, self.device_mesh.get_group(TP.DP_DIM))
