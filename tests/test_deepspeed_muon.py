"""DeepSpeed's Muon config through ``from_deepspeed_config`` / ``lightning-zero from-deepspeed``: torch's Muon on the
hidden matrices + AdamW on the rest with DeepSpeed's values and defaults ([Note: DeepSpeed's Muon]), what differs
named, what the run would refuse refused, and the translated optimizers training a Lightning fit at ZeRO-2."""
import json
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import DeepSpeedConfigError, DeepSpeedWarmupLR, from_deepspeed_config, muon_split
from lightning_zero.tools.cli import main as cli_main
from tests.helpers.whole_tensor_runs import newton_schulz_fp32

ROOT = Path(__file__).resolve().parents[1]
DOCS_EXAMPLE = {  # DeepSpeed's config-json.md example of Muon
    "optimizer": {"type": "Muon", "params": {"lr": 0.001, "momentum": 0.9, "weight_decay": 0.0, "muon_lr": 0.001,
                                             "ns_method": "gram"}},
    "zero_optimization": {"stage": 3, "save_muon_momentum_buffer_in_memory": True}}


def test_deepspeed_muon_becomes_torch_muon_and_adamw_with_deepspeeds_values():
    t = from_deepspeed_config(DOCS_EXAMPLE)
    assert t.optimizer == (torch.optim.Muon, {"lr": 0.001, "momentum": 0.9, "weight_decay": 0.0})
    # the Adam group: the config's lr and weight decay, MuonWithAuxAdam's betas and eps
    assert t.rest_optimizer == (torch.optim.AdamW, {"lr": 0.001, "betas": (0.9, 0.95), "eps": 1e-10,
                                                    "weight_decay": 0.0})
    assert set(t.differs) == {"optimizer.params.use_muon", "optimizer.params.ns_method"}
    assert "zero_optimization.save_muon_momentum_buffer_in_memory" in t.ignored
    # nothing given: MuonWithAuxAdam's defaults for each group, written out (never torch's own)
    t = from_deepspeed_config({"optimizer": {"type": "Muon"}, "zero_optimization": {"stage": 2}})
    assert t.optimizer == (torch.optim.Muon, {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0})
    assert t.rest_optimizer == (torch.optim.AdamW, {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10,
                                                    "weight_decay": 0.0})
    assert "optimizer.params.ns_method" in t.differs  # DeepSpeed's default is the Gram iteration
    # muon_lr / adam_lr override lr per group; "standard" is torch's iteration: nothing differs there
    t = from_deepspeed_config({"optimizer": {"type": "Muon", "params": {
        "lr": 1e-3, "muon_lr": 2e-2, "adam_lr": 5e-4, "betas": [0.8, 0.99], "eps": 1e-8, "weight_decay": 0.1,
        "ns_method": "standard"}}})
    assert t.optimizer[1]["lr"] == 2e-2 and t.rest_optimizer[1] == {"lr": 5e-4, "betas": (0.8, 0.99), "eps": 1e-8,
                                                                   "weight_decay": 0.1}
    assert set(t.differs) == {"optimizer.params.use_muon"}
    # HF's "auto" resolves for Muon as for AdamW
    t = from_deepspeed_config({"optimizer": {"type": "Muon", "params": {"lr": "auto", "weight_decay": "auto"}}},
                              auto={"learning_rate": 3e-3, "weight_decay": 0.01})
    assert t.optimizer[1]["lr"] == 3e-3 and t.rest_optimizer[1]["weight_decay"] == 0.01


def test_deepspeed_adafactor_is_torchs():
    t = from_deepspeed_config({"optimizer": {"type": "Adafactor", "params": {"lr": 1e-2}},
                               "zero_optimization": {"stage": 2}})
    assert t.optimizer == (torch.optim.Adafactor, {"lr": 1e-2})
    overrides, notes = t.hydra_overrides()
    assert "optim.name=adafactor" in overrides and "optim.lr=0.01" in overrides
    assert not any("optimizer" in n for n in notes)  # torch's Adafactor with its defaults: nothing to say


@pytest.mark.parametrize("cfg,match", [
    ({"optimizer": {"type": "Muon", "params": {"nesterov": False}}},
     "unsupported params \\['nesterov'\\]. Allowed: lr, muon_lr, adam_lr, momentum, weight_decay, betas, eps"),
    ({"optimizer": {"type": "Muon", "params": {"ns_method": "svd"}}}, "ns_method='svd'. Allowed: gram, standard"),
    ({"optimizer": {"type": "Muon", "params": {"adam_lr": -1.0}}}, "do not fit AdamW"),
    ({"optimizer": {"type": "Muon"}, "zero_optimization": {"stage": 3, "save_muon_momentum_buffer_in_memory": True,
                                                           "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}},
     "Muon updates whole tensors.*Allowed: Muon with its state on the device or offloaded to host memory"),
    ({"optimizer": {"type": "Lamb"}}, "Allowed: Adam, AdamW, SGD, Adagrad, Adafactor, Muon"),
])
def test_what_muon_cannot_take_is_refused(cfg, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        from_deepspeed_config(cfg)


class _Lm(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.body, self.norm = nn.Embedding(11, 8), nn.Linear(8, 8), nn.LayerNorm(8)
        self.head = nn.Linear(8, 11, bias=False)

    def get_output_embeddings(self):
        return self.head

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.body(self.embed(x)))))


def test_configure_optimizers_splits_the_module_and_schedules_both():
    t = from_deepspeed_config({**DOCS_EXAMPLE, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_max_lr": 1e-2, "warmup_num_steps": 4}}})
    model = _Lm()
    (muon, adamw), scheds = t.configure_optimizers(model)
    hidden, rest = muon_split(model)
    assert hidden == [model.body.weight]  # the embedding, the head, the bias and the norm are AdamW's
    assert muon.param_groups[0]["params"] == hidden and adamw.param_groups[0]["params"] == rest
    assert [type(s["scheduler"]) for s in scheds] == [DeepSpeedWarmupLR] * 2
    assert [s["scheduler"].optimizer for s in scheds] == [muon, adamw]
    with pytest.raises(DeepSpeedConfigError, match="pass the module"):
        t.configure_optimizers(model.parameters())


@pytest.fixture
def fp32_newton_schulz(monkeypatch):
    import torch.optim._muon as muon

    monkeypatch.setattr(muon, "_zeropower_via_newtonschulz", newton_schulz_fp32)


def _deepspeed_muon_step(w, g, buf, lr, momentum, wd):
    """DeepSpeed's Muon step (original_muon.py ``muon_update``, ns_method='standard') written out: Nesterov
    momentum by lerp, 5 quintic Newton-Schulz steps on the wide orientation (here in fp32), the
    max(1, rows/cols)^0.5 scale, decoupled weight decay."""
    buf.lerp_(g, 1 - momentum)
    update = g.lerp(buf, momentum)
    x = update.mT if update.size(-2) > update.size(-1) else update
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        a = x @ x.mT
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    x = x.mT if update.size(-2) > update.size(-1) else x
    w.mul_(1 - lr * wd).add_(x * max(1, w.size(-2) / w.size(-1)) ** 0.5, alpha=-lr)


def test_translated_muon_steps_as_deepspeeds_standard_muon(fp32_newton_schulz):
    t = from_deepspeed_config({"optimizer": {"type": "Muon", "params": {"lr": 0.05, "momentum": 0.9,
                                                                       "weight_decay": 0.1, "ns_method": "standard"}}})
    torch.manual_seed(0)
    w = torch.randn(16, 8)  # rows > cols: the scale is sqrt(2)
    ours = nn.Parameter(w.clone())
    opt = t.optimizer[0]([ours], **t.optimizer[1])
    ref, buf = w.clone(), torch.zeros_like(w)
    for _ in range(3):
        g = torch.randn_like(w)
        ours.grad = g.clone()
        opt.step()
        _deepspeed_muon_step(ref, g.clone(), buf, 0.05, 0.9, 0.1)
    assert torch.allclose(ours.detach(), ref, rtol=1e-5, atol=1e-6), (ours.detach() - ref).abs().max()
    assert not torch.allclose(ref, w, atol=1e-2)


class _Manual(LightningModule):
    """The translated optimizers in a Lightning fit: manual optimization, one backward, both steps."""

    def __init__(self, t):
        super().__init__()
        torch.manual_seed(0)
        self.t, self.lm, self.automatic_optimization = t, _Lm(), False

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self.lm(x).flatten(0, 1), y.flatten())
        opts = self.optimizers()
        for o in opts:
            o.zero_grad()
        self.manual_backward(loss)
        for o in opts:
            o.step()
        return loss

    def configure_optimizers(self):
        return self.t.configure_optimizers(self.lm)


@pytest.mark.timeout(300)
def test_translated_muon_trains_a_zero2_fit_as_the_plain_optimizers(tmp_path, fp32_newton_schulz):
    t = from_deepspeed_config({"optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-2}},
                               "zero_optimization": {"stage": 2}})
    torch.manual_seed(1)
    data = TensorDataset(torch.randint(0, 11, (32, 6)), torch.randint(0, 11, (32, 6)))
    model = _Manual(t)
    plain = _Manual(t).lm  # same seed: same weights; stepped below without Lightning or ZeRO
    trainer = Trainer(strategy=t.make_strategy(), accelerator="cpu", devices=1, max_epochs=1, logger=False,
                      use_distributed_sampler=False,  # the batches in order, as the plain loop below
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path))
    trainer.fit(model, DataLoader(data, batch_size=8))
    opts = t.configure_optimizers(plain)
    for x, y in DataLoader(data, batch_size=8):
        loss = nn.functional.cross_entropy(plain(x).flatten(0, 1), y.flatten())
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
    got, want = model.lm.state_dict(), plain.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert not torch.allclose(want["body.weight"], _Manual(t).lm.body.weight)  # it trained


def test_cli_writes_the_recipes_muon_overrides(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    from hydra import compose, initialize_config_dir
    from t5_config import validate_schema

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**DOCS_EXAMPLE, "optimizer": {"type": "Muon", "params": {
        "lr": 2e-4, "adam_lr": 2e-6, "weight_decay": 0.01}}}))
    out = tmp_path / "ds.overrides"
    assert cli_main(["from-deepspeed", str(path), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "optimizer.params.use_muon: differs here" in err and "optimizer.params.ns_method: differs here" in err
    assert "configure_optimizers(module) builds exactly these" in err
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("t5_finetune", overrides=out.read_text().split())
    validate_schema(cfg)
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay, cfg.strategy.stage) == ("muon", 2e-6, 0.01, 3)
