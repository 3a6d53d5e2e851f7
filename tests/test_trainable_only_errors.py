"""Trainable-only checkpoints refused clearly ([Note: trainable-only checkpoints]): a resume into a model built
from another base, ``load_from_checkpoint`` / ``consolidate`` with the recorded base changed or gone, the
strategies' knobs; and the stage-3 LoRA shape itself (an eval-mode HF model, a frozen weight inside a unit)
training as without ZeRO. One process, a Trainer with one device (its own tests cover 2 ranks)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint.trainable_only import BaseMismatchError
from lightning_zero.lightning.fabric_strategy import ZeroFabricStrategy
from lightning_zero.tools.cli import main as cli
from tests.helpers.lightning_models import trainer_kwargs
from tests.helpers.lora_models import LoraModule, write_base


def _fit(root: Path, base: Path, max_steps: int = 1, ckpt_path=None, stage: int = 3, **knobs) -> Trainer:
    trainer = Trainer(strategy=ZeroStrategy(stage=stage, **knobs),
                      callbacks=[ModelCheckpoint(dirpath=root, filename="ckpt", every_n_train_steps=1)],
                      **trainer_kwargs(devices=1, max_steps=max_steps, enable_checkpointing=True,
                                       default_root_dir=str(root)))
    module = LoraModule(str(base))
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


@pytest.fixture
def saved(tmp_path):
    base = write_base(tmp_path / "base")
    _fit(tmp_path, base, checkpoint_trainable_only=True, checkpoint_base=str(base))
    return tmp_path / "ckpt.ckpt", base


@pytest.mark.timeout(300)
def test_resume_into_another_base_is_refused(saved, tmp_path):
    ckpt, base = saved
    other = write_base(tmp_path / "other", seed=3)
    with pytest.raises(BaseMismatchError, match=r"The base model differs from the one this checkpoint was trained "
                                                rf"on: expected {re.escape(str(base))} hash sha256:[0-9a-f]{{64}}, "
                                                r"got sha256:[0-9a-f]{64} \(the frozen weights of the model"):
        _fit(tmp_path / "resume", other, max_steps=2, ckpt_path=str(ckpt), checkpoint_trainable_only=True,
             checkpoint_base=str(other))
    # the same base resumes (and a stage-2 run reads the stage-3 checkpoint: the hash is of whole tensors)
    _fit(tmp_path / "resume", base, max_steps=2, ckpt_path=str(ckpt), stage=2, checkpoint_trainable_only=True,
         checkpoint_base=str(base))


@pytest.mark.timeout(300)
def test_changed_or_missing_base_is_refused_when_read(saved, tmp_path):
    ckpt, base = saved
    LoraModule.load_from_checkpoint(str(ckpt), base=str(base))  # reads
    write_base(tmp_path / "other", seed=3)
    shutil.copy(tmp_path / "other" / "model.safetensors", base / "model.safetensors")  # the base changed
    with pytest.raises(BaseMismatchError, match=rf"expected {re.escape(str(base))} hash sha256:\w+, got "
                                                rf"sha256:\w+ \(the weights read from {re.escape(str(base))}\)"):
        LoraModule.load_from_checkpoint(str(ckpt), base=str(tmp_path / "other"))
    assert cli(["consolidate", str(ckpt), str(tmp_path / "out.pt"), "--quiet"]) == 2
    assert not (tmp_path / "out.pt").exists()
    shutil.rmtree(base)
    with pytest.raises(BaseMismatchError, match=rf"The frozen base of this trainable-only checkpoint is missing: "
                                                rf"'{re.escape(str(base))}' does not exist"):
        LoraModule.load_from_checkpoint(str(ckpt), base=str(tmp_path / "other"))
    # the adapter alone needs no base
    assert cli(["consolidate", str(ckpt), str(tmp_path / "adapter.pt"), "--adapter", "--quiet"]) == 0
    assert all("lora_" in k for k in torch.load(tmp_path / "adapter.pt"))


@pytest.mark.parametrize("cls", [ZeroStrategy, ZeroFabricStrategy])
def test_knobs_are_refused_with_what_is_allowed(cls, tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint_trainable_only=True needs the frozen base's source\. Allowed: "
                                         r"checkpoint_base=DIR"):
        cls(checkpoint_trainable_only=True)
    with pytest.raises(ValueError, match=r"checkpoint_base='/no/such' : no such|checkpoint_base='/no/such': no such "
                                         r"directory or file\. Allowed: a save_pretrained directory"):
        cls(checkpoint_trainable_only=True, checkpoint_base="/no/such")
    with pytest.raises(ValueError, match=r"checkpoint_base=.* is only read by trainable-only saves"):
        cls(checkpoint_base=str(tmp_path))
    with pytest.raises(ValueError, match=r"checkpoint_trainable_only must be True or False"):
        cls(checkpoint_trainable_only="yes", checkpoint_base=str(tmp_path))
    assert cls(checkpoint_trainable_only=True, checkpoint_base=str(tmp_path)).checkpoints.trainable_only_base \
        == str(tmp_path)


def test_trainer_takes_the_base_from_load_weights_from(tmp_path):
    s = ZeroStrategy(stage=3, checkpoint_trainable_only=True, load_weights_from=str(tmp_path))
    assert s.checkpoints.trainable_only_base == str(tmp_path)
    with pytest.raises(ValueError, match=r"checkpoint_trainable_only=True writes sharded checkpoint directories"):
        ZeroStrategy(checkpoint_trainable_only=True, checkpoint_base=str(tmp_path), checkpoint_format="full")
    from lightning_zero.lightning.pipeline_strategy import ZeroPipelineStrategy

    with pytest.raises(ValueError, match=r"checkpoint_trainable_only=True is not available with "
                                         r"pipeline_parallel_size.*Allowed: checkpoint_trainable_only=False"):
        ZeroPipelineStrategy(pipeline_parallel_size=2, checkpoint_trainable_only=True, checkpoint_base=str(tmp_path))


@pytest.mark.timeout(300)
def test_full_checkpoint_has_no_adapter_form(tmp_path):
    base = write_base(tmp_path / "base")
    _fit(tmp_path, base, stage=2)
    for flag in ("--adapter", "--merged"):
        assert cli(["consolidate", str(tmp_path / "ckpt.ckpt"), str(tmp_path / "x.pt"), flag, "--quiet"]) == 2


@pytest.mark.timeout(300)
def test_stage3_lora_in_eval_mode_trains_as_without_zero(tmp_path):
    """HF's from_pretrained returns the model in eval mode and Lightning keeps it: stage 3 released a unit as
    soon as its trainable gradients were done, before its frozen weight computed the input's gradient."""
    base = write_base(tmp_path / "base")
    losses = {}
    for name, strategy in (("zero3", ZeroStrategy(stage=3)), ("plain", "auto")):
        module = LoraModule(str(base))
        assert not module.model.base_model.model.training  # from_pretrained: eval mode
        Trainer(strategy=strategy, **trainer_kwargs(devices=1, max_steps=3)).fit(module)
        losses[name] = module.losses
    torch.testing.assert_close(losses["zero3"], losses["plain"], rtol=1e-5, atol=0)


def test_base_hash_is_kept_until_a_frozen_weight_changes(monkeypatch):
    """The hash of a large base is not recomputed at every save, but any in-place write to a frozen weight
    (a new version of the tensor) recomputes it."""
    from lightning_zero.checkpoint import trainable_only as TO

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    net[0].requires_grad_(False)
    state = {n: t.detach() for n, t in net.state_dict(keep_vars=True).items()}
    names = TO.frozen_names(net, state)
    assert names == ["0.bias", "0.weight"]
    calls = []
    monkeypatch.setattr(TO, "digest", lambda pairs, real=TO.digest: calls.append(1) or real(pairs))
    first = TO.live_digest(net, state, names)
    assert TO.live_digest(net, state, names) == first and len(calls) == 1
    with torch.no_grad():
        net[1].weight.add_(1.0)  # trainable: not part of the base
    assert TO.live_digest(net, state, names) == first and len(calls) == 1
    before = net[0].weight[0, 0].item()
    with torch.no_grad():
        net[0].weight[0, 0] += 1.0
    changed = TO.live_digest(net, state, names)
    assert changed != first and len(calls) == 2
    with torch.no_grad():
        net[0].weight[0, 0] = before
    assert TO.live_digest(net, state, names) == first and len(calls) == 3


@pytest.mark.timeout(300)
def test_async_save_writes_the_trainable_part_in_the_background(tmp_path):
    """With async_save the reference and the hash are taken on the training thread, the write in the
    background: the last checkpoint reads back as the trained module."""
    import json

    base = write_base(tmp_path / "base")
    trainer = _fit(tmp_path, base, max_steps=2, async_save=True, checkpoint_trainable_only=True,
                   checkpoint_base=str(base))
    info = json.loads((tmp_path / "ckpt.ckpt" / "zero_checkpoint.json").read_text())
    assert info["trainable_only"]["base"]["source"] == str(base) and info["version"] == 2
    want = trainer.lightning_module.state_dict()
    got = LoraModule.load_from_checkpoint(str(tmp_path / "ckpt.ckpt"), base=str(base)).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.timeout(300)
def test_malformed_reference_is_one_clear_error(saved):
    """A reference edited (and the json resealed) is refused by name, not a KeyError deep in a reader."""
    import json

    from lightning_zero.checkpoint import integrity

    ckpt, base = saved
    info_file = ckpt / "zero_checkpoint.json"
    info = json.loads(info_file.read_text())
    del info["trainable_only"]["hash"]
    info.pop(integrity.SEAL_KEY)
    info_file.write_text(json.dumps(integrity.seal(info)))
    with pytest.raises(ValueError, match=r"Corrupt checkpoint metadata: its 'trainable_only' entry has no valid hash"):
        LoraModule.load_from_checkpoint(str(ckpt), base=str(base))


@pytest.mark.timeout(300)
def test_trainable_only_checkpoint_at_an_fsspec_url(tmp_path, monkeypatch):
    """Saved to ``memory://``, resumed and consolidated from there: the reference and the hash travel with
    the directory, the base stays where it was recorded."""
    import uuid

    import fsspec

    from lightning_zero.checkpoint import location

    monkeypatch.setenv(location.STAGING_ENV, str(tmp_path / "staging"))
    url = f"memory:///lz-{uuid.uuid4().hex[:8]}"
    try:
        base = write_base(tmp_path / "base")
        knobs = dict(checkpoint_trainable_only=True, checkpoint_base=str(base))
        trainer = Trainer(strategy=ZeroStrategy(stage=3, **knobs),
                          callbacks=[ModelCheckpoint(dirpath=url, filename="ckpt", every_n_train_steps=1)],
                          **trainer_kwargs(devices=1, max_steps=1, enable_checkpointing=True,
                                           default_root_dir=str(tmp_path)))
        module = LoraModule(str(base))
        trainer.fit(module)
        want = module.state_dict()
        assert cli(["consolidate", f"{url}/ckpt.ckpt", str(tmp_path / "whole.pt"), "--quiet"]) == 0
        whole = torch.load(tmp_path / "whole.pt")
        assert whole.keys() == want.keys() and all(torch.equal(whole[k], want[k]) for k in want)
        with pytest.raises(BaseMismatchError, match="The base model differs"):
            _fit(tmp_path / "other", write_base(tmp_path / "other_base", seed=3), max_steps=2,
                 ckpt_path=f"{url}/ckpt.ckpt", **knobs)
        # last: Lightning's ModelCheckpoint removes a remote checkpoint it resumed from when it saves its own
        _fit(tmp_path / "resume", base, max_steps=2, ckpt_path=f"{url}/ckpt.ckpt", **knobs)
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists(url[len("memory://"):]):
            fs.rm(url[len("memory://"):], recursive=True)
