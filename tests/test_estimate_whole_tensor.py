"""`lightning-zero estimate --optimizer muon|adafactor`: whole-tensor state by parameter shape, booked on owner ranks
([Note: whole-tensor state in the estimate]). The exact per-rank bytes against a real 2-rank recipe fit are in
tests/test_t5_optim.py (``test_whole_tensor_choices_train_at_zero_stages``)."""
import pytest
import torch
from torch import nn

from lightning_zero import estimate_model_states, muon_split
from lightning_zero.tools.cli import main as cli_main
from lightning_zero.tools.estimate_whole_tensor import whole_tensor_state


class _Net(nn.Module):
    """An embedding, a big and two small hidden matrices, a 3-D kernel, biases and a norm: every shape rule."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.big, self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16), nn.Linear(16, 16)
        self.conv = nn.Conv1d(16, 8, 3)
        self.norm = nn.LayerNorm(16)


def _real_state_bytes(opts) -> int:
    return sum(t.numel() * t.element_size() for o in opts for st in o.state.values() for t in st.values()
               if torch.is_tensor(t) and t.ndim > 0)


@pytest.mark.parametrize("name", ["muon", "adafactor"])
def test_state_bytes_are_torchs_own(name):
    """The shape rules give the bytes torch's optimizers really allocate, stepped once on the whole module."""
    net = _Net()
    if name == "muon":
        hidden, rest = muon_split(net)
        opts = [torch.optim.Muon(hidden), torch.optim.AdamW(rest)]
    else:
        opts = [torch.optim.Adafactor(net.parameters())]
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    for o in opts:
        o.step()
    assert whole_tensor_state(name, net).total() == _real_state_bytes(opts)


def test_rows_book_the_most_loaded_owner_and_say_the_spread():
    net = _Net()
    est = estimate_model_states(net, world_size=2, optimizer="adafactor")
    state = est.whole_tensor
    per = state.per_rank(2)
    assert sum(per) == state.total() and max(per) > min(per)  # few tensors: the owners cannot balance
    rows = {r.setting: r for r in est.rows}
    assert not any("nvme" in s for s in rows)  # the run refuses NVMe state for whole-tensor optimizers
    assert rows["zero0"].states["optimizer_state"] == pytest.approx(state.total())  # whole on every rank
    for s in ("zero1", "zero2", "zero3"):
        assert rows[s].states["optimizer_state"] == pytest.approx(max(per))
    # the owners' transient whole masters + gradients: device step buffers, or host memory when offloaded
    plain = estimate_model_states(net, world_size=2, optimizer="adamw", settings=["zero2", "zero2_offload"])
    assert rows["zero2"].buffers["step"] == pytest.approx(plain.row("zero2").buffers["step"] + state.transient(2))
    assert rows["zero2_offload"].host_per_rank - plain.row("zero2_offload").host_per_rank == pytest.approx(
        state.transient(2) + state.k(True, 2) * est.info.trainable / 2 - 8 * est.info.trainable / 2)
    assert f"({max(per) / (sum(per) / 2):.2f}x, booked in the table)" in str(est)


def test_muon_keeps_adamw_sharded_and_momentum_on_owners():
    net = _Net()
    state = estimate_model_states(net, world_size=4, optimizer="muon").whole_tensor
    hidden, rest = muon_split(net)
    assert state.elementwise_state == 8 * sum(p.numel() for p in rest)
    # the engine's balance (owner_step.py): the Newton-Schulz cost, largest first, to the least loaded rank
    owners = state.owners(4)
    assert [len(o) for o in owners] == [1, 1, 1, 0] and owners[3] == []
    assert state.per_rank(4)[3] == state.elementwise_state / 4


def test_what_the_estimate_cannot_do_is_refused():
    with pytest.raises(ValueError, match="needs the model. Allowed: an nn.Module"):
        estimate_model_states(10**6, optimizer="muon")
    with pytest.raises(ValueError, match="Whole-tensor .*: muon, adafactor"):
        estimate_model_states(10**6, optimizer="lamb")


def test_cli_estimate_with_muon(capsys):
    assert cli_main(["estimate", "--model", "t5_tiny", "--ranks", "2", "--optimizer", "muon"]) == 0
    out = capsys.readouterr().out
    assert "optimizer muon (K = by shape)" in out and "optimizer muon: whole-tensor, stepped on each" in out
    assert "zero3_offload_nvme" not in out and "| zero3_offload " in out
