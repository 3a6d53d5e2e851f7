"""Whole-tensor optimizers in the estimate: their state by parameter shape, and the owner-rank step's balance.

[Note: whole-tensor state in the estimate]
The estimate's model of optimizer state is K bytes per parameter element, sharded evenly at stages 1-3
(engine/memory/floors.py). A whole-tensor optimizer's state follows each parameter's shape instead, and lives
whole on the parameter's owner rank ([Note: owner-rank step]):

    muon       torch's Muon on the hidden matrices (``lightning_zero.muon_split``): one momentum, 4 B/element,
               on the owner; AdamW on the rest (embeddings, head, biases, norms): 8 B/element, sharded
    adafactor  a matrix (..., m, n): its row and column second moments, (m + n) * 4 B per leading index; any
               other tensor its full second moment, 4 B/element; all on the owner

Owners are assigned by the engine's rule (owner_step.py: largest cost first -- Muon: m * n * min(m, n), the
Newton-Schulz work; otherwise the numel -- to the least loaded rank), so the ranks hold different state. A row
books its most loaded rank's bytes (what has to fit) through an effective K (the max rank's bytes times the
ranks it is sharded over, per trainable element: floors.py then divides it back), and the estimate states the
spread (max rank vs the mean). During the step an owner also holds a whole fp32 master and gradient of every
parameter it owns (8 B/element, freed after the scatter): added to the step's buffers (to host memory when
the step runs there, offloaded). Stage 0 steps whole
parameters on every rank, each holding all the state. NVMe optimizer state is refused for a whole-tensor
optimizer, so those rows are left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..engine.optim.owner_step import newton_schulz_cost, numel_cost

WHOLE_TENSOR = ("muon", "adafactor")


def _numel(shape: tuple) -> int:
    return numel_cost(shape)


def adafactor_state(shape: tuple) -> int:
    """Bytes of torch's Adafactor state of one parameter (its 0-d step aside)."""
    if len(shape) < 2:
        return 4 * _numel(shape)
    return 4 * _numel(shape[:-2]) * (shape[-2] + shape[-1])


@dataclass
class WholeTensorState:
    """The state of one whole-tensor optimizer choice over a model's trainable parameters."""

    optimizer: str
    owned: list[tuple[tuple, int, int]]  # (shape, state bytes, owner-balance cost) of each whole-tensor parameter
    elementwise_state: float  # bytes of the elementwise part (Muon's AdamW), sharded evenly
    trainable: int

    def owners(self, ranks: int) -> list[list[tuple]]:
        """The parameters each rank owns, by the engine's rule (owner_step.py ``OwnerStep.sync``)."""
        load, mine = [0] * ranks, [[] for _ in range(ranks)]
        for item in sorted(self.owned, key=lambda it: -it[2]):  # stable: equal costs keep their order
            r = min(range(ranks), key=lambda r: (load[r], r))
            load[r] += item[2]
            mine[r].append(item)
        return mine

    def per_rank(self, ranks: int) -> list[float]:
        """Optimizer-state bytes of each rank when ``ranks`` ranks share the step."""
        return [sum(it[1] for it in mine) + self.elementwise_state / ranks for mine in self.owners(ranks)]

    def total(self) -> float:
        return sum(it[1] for it in self.owned) + self.elementwise_state

    def k(self, sharded: bool, ranks: int) -> float:
        """The effective bytes per trainable element that books the most loaded rank's state (see the Note)."""
        if not self.trainable:
            return 0.0
        return (max(self.per_rank(ranks)) * ranks if sharded else self.total()) / self.trainable

    def transient(self, ranks: int) -> float:
        """The most loaded rank's whole fp32 masters + gradients during the step (bytes)."""
        return max(8.0 * sum(_numel(it[0]) for it in mine) for mine in self.owners(ranks))

    def runs_under(self, plan: Any) -> bool:
        """Whether a run takes this optimizer under ``plan``: the engine's own check (its optimizer kind's),
        asked of a stand-in; it refuses NVMe optimizer state, whose step streams slices."""
        import torch

        from ..engine.optim.kinds import KindSetup, kind_of

        cls = {"muon": torch.optim.Muon, "adafactor": torch.optim.Adafactor}[self.optimizer]
        stand_in = cls([torch.zeros(2, 2, requires_grad=True)])
        try:
            kind_of(stand_in).check(stand_in, KindSetup(plan, None, [stand_in]))
        except ValueError:
            return False
        return True

    def line(self, ranks: int) -> str:
        per = self.per_rank(ranks)
        mean = sum(per) / len(per)
        what = {"muon": "Muon's momentum (4 B/elem) on the hidden matrices on their owners, AdamW (8 B/elem) on "
                        "the rest sharded",
                "adafactor": "factored second moments ((m + n) x 4 B per matrix) on their owners"}[self.optimizer]
        return (f"optimizer {self.optimizer}: whole-tensor, stepped on each parameter's owner rank "
                f"(docs/optimizers.md): {what}; {self.total() / 2**20:.1f} MiB in all. At stages 1-3 over {ranks} "
                f"rank(s) the most loaded rank holds {max(per) / 2**20:.2f} MiB vs the mean {mean / 2**20:.2f} MiB "
                f"({max(per) / mean if mean else 1:.2f}x, booked in the table) and, during the step, "
                f"{self.transient(ranks) / 2**20:.1f} MiB of whole fp32 masters + gradients (step buffers; host/rank "
                "when offloaded); "
                "stage 0: all of it on every rank; NVMe optimizer state: refused (rows left out)")


def whole_tensor_state(optimizer: str, module: Any) -> WholeTensorState:
    """The state of ``optimizer`` ("muon" or "adafactor") over ``module``'s trainable parameters (a meta-device
    module works)."""
    params = [p for p in module.parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in params)
    if optimizer == "adafactor":
        owned = [(tuple(p.shape), adafactor_state(tuple(p.shape)), p.numel()) for p in params]
        return WholeTensorState(optimizer, owned, 0.0, trainable)
    from ..engine.optim.muon_split import muon_split

    hidden, rest = muon_split(module)
    owned = [(tuple(p.shape), 4 * p.numel(), newton_schulz_cost(tuple(p.shape))) for p in hidden]
    return WholeTensorState(optimizer, owned, 8.0 * sum(p.numel() for p in rest), trainable)


def t5_meta_module(dims: Any) -> Any:
    """The HF T5 of ``dims`` on the meta device (nothing allocated): the parameters' shapes."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=dims.vocab_size, d_model=dims.d_model, d_ff=dims.d_ff, num_layers=dims.num_layers,
                   num_decoder_layers=dims.dec_layers, num_heads=dims.num_heads, d_kv=dims.d_kv,
                   relative_attention_num_buckets=dims.relative_attention_num_buckets,
                   feed_forward_proj="gated-gelu" if dims.gated else "relu", tie_word_embeddings=dims.tied)
    with torch.device("meta"):
        return T5ForConditionalGeneration(cfg)


def state_for(optimizer: str, model: Any, t5: Optional[Any]) -> WholeTensorState:
    """:func:`whole_tensor_state` of the estimate's model: an ``nn.Module``, or a T5 (built on the meta device);
    a bare parameter count has no shapes, which these optimizers' state depends on."""
    from torch import nn

    if isinstance(model, nn.Module):
        return whole_tensor_state(optimizer, model)
    if t5 is not None:
        return whole_tensor_state(optimizer, t5_meta_module(t5))
    raise ValueError(f"optimizer {optimizer!r} keeps state by parameter shape: the estimate needs the model. "
                     "Allowed: an nn.Module (--module pkg.mod:factory) or a T5 preset / T5Dims with "
                     f"{', '.join(WHOLE_TENSOR)}; a parameter count with an elementwise optimizer (adamw, sgd, ...).")
