"""Weights out of a stage-3 sharded checkpoint of a LightningModule holding a tiny GPT-2 (built from a config, no
download), trained 3 steps on 2 forked ranks: ``consolidate --lightning`` for ``load_from_checkpoint`` and a
DDP resume, ``load_from_checkpoint(DIR)`` directly, and ``export --hf`` for ``from_pretrained``, strictly."""
import json
import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from lightning_zero.tools.cli import main as cli_main

transformers = pytest.importorskip("transformers")

from tests.helpers.gpt2_module import GPTModule, gpt2_config  # noqa: E402


def _fit(strategy, out, epochs, ckpt_path=None, ckpt_dir=None):
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1)] if ckpt_dir else []
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, limit_train_batches=3,
                      logger=False, enable_checkpointing=bool(ckpt_dir), callbacks=callbacks,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(GPTModule(gpt2_config().to_dict(), str(out)), ckpt_path=ckpt_path)
    return torch.load(os.path.join(out, f"weights_step{3 * epochs}.pt"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt2_zero3")
    weights = _fit(ZeroStrategy(stage=3, start_method="fork"), out, 1, ckpt_dir=out / "ck")
    return {"out": out, "dir": out / "ck" / "epoch=0.ckpt", "weights": weights}


def _assert_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.timeout(240)
def test_consolidate_lightning_file_and_the_directory_load_with_load_from_checkpoint(trained, tmp_path, capsys):
    out = tmp_path / "model.ckpt"
    assert cli_main(["consolidate", str(trained["dir"]), str(out), "--lightning"]) == 0
    printed = capsys.readouterr()
    assert "weights only" in printed.out and "B/s" in printed.err  # the progress bar, with its rate, on stderr
    ckpt = torch.load(out, weights_only=False)
    assert ckpt["pytorch-lightning_version"] == pl.__version__ and ckpt["global_step"] == 3
    assert ckpt["hyper_parameters"]["config"]["n_layer"] == 2 and "loops" in ckpt
    assert "optimizer_states" not in ckpt  # weights only, as ModelCheckpoint(save_weights_only=True)
    _assert_equal(GPTModule.load_from_checkpoint(out).state_dict(), trained["weights"])
    # the sharded directory itself, with no conversion step
    direct = GPTModule.load_from_checkpoint(trained["dir"], map_location="cpu")
    _assert_equal(direct.state_dict(), trained["weights"])
    assert direct.hparams.lr == 1e-2
    # a directory that is not a checkpoint: one error naming the command
    with pytest.raises(IsADirectoryError, match="lightning-zero consolidate DIR OUT.ckpt --lightning"):
        GPTModule.load_from_checkpoint(tmp_path)
    assert cli_main(["consolidate", str(trained["dir"]), str(tmp_path / "x.pt"), "--optimizer"]) == 2
    assert "--optimizer needs --lightning" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_consolidated_with_optimizer_resumes_under_ddp_as_an_uninterrupted_ddp_run(trained, tmp_path, capsys):
    out = tmp_path / "model.ckpt"
    assert cli_main(["consolidate", str(trained["dir"]), str(out), "--lightning", "--optimizer", "--quiet"]) == 0
    assert capsys.readouterr().err == ""  # --quiet: no progress bar
    ckpt = torch.load(out, weights_only=False)
    assert len(ckpt["optimizer_states"]) == 1 and ckpt["lr_schedulers"][0]["last_epoch"] == 1  # stepped per epoch
    resumed = _fit("ddp_fork", tmp_path, 2, ckpt_path=str(out))  # epoch 1: steps 4-6 from the file
    (tmp_path / "ref").mkdir()
    reference = _fit("ddp_fork", tmp_path / "ref", 2)  # 6 steps straight, from the same seed and data
    for k, v in reference.items():
        torch.testing.assert_close(resumed[k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.timeout(120)
def test_export_hf_loads_strictly_and_a_wrong_prefix_is_an_error(trained, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert cli_main(["export", str(trained["dir"]), str(hf), "--hf"]) == 0  # prefix and config found
    printed = capsys.readouterr()
    assert "prefix 'model.'" in printed.out and "B/s" in printed.err
    assert sorted(os.listdir(hf)) == ["config.json", "model.safetensors"]
    model, info = transformers.GPT2LMHeadModel.from_pretrained(hf, output_loading_info=True)
    assert all(not v for v in info.values()), info  # nothing missing, unexpected or mismatched
    want = {k[len("model."):]: v for k, v in trained["weights"].items()}
    _assert_equal(model.state_dict(), want)
    auto = transformers.AutoModelForCausalLM.from_pretrained(hf)
    _assert_equal(auto.state_dict(), want)
    assert auto.lm_head.weight.data_ptr() == auto.transformer.wte.weight.data_ptr()  # still tied

    # --config as a json file and an explicit prefix give the same files
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(gpt2_config().to_dict()))
    assert cli_main(["export", str(trained["dir"]), str(tmp_path / "hf2"), "--hf", "--prefix", "model.",
                     "--config", str(cfg), "--quiet"]) == 0
    assert (tmp_path / "hf2" / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()
    capsys.readouterr()

    # a wrong prefix: every key missing, an error (and nothing written), never random weights
    assert cli_main(["export", str(trained["dir"]), str(tmp_path / "bad"), "--hf", "--prefix", "net.",
                     "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "does not match GPT2LMHeadModel" in err and "missing: transformer.wte.weight" in err
    assert not (tmp_path / "bad").exists()
    # a config of another size: the shapes disagree
    small = gpt2_config()
    small.n_embd = 8
    cfg.write_text(json.dumps(small.to_dict()))
    assert cli_main(["export", str(trained["dir"]), str(tmp_path / "bad"), "--hf", "--config", str(cfg),
                     "--prefix", "model.", "--quiet"]) == 2
    assert "shape mismatch: transformer.wte.weight: checkpoint (61, 16), model (61, 8)" in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_load_from_checkpoint_with_lightnings_defaults_and_every_map_location(trained, tmp_path):
    from lightning_zero.lightning.lightning_io import load_as_lightning_checkpoint

    # Lightning's defaults: its own map_location callable (None, "leave it", for a CPU tensor), weights_only=None
    _assert_equal(GPTModule.load_from_checkpoint(trained["dir"]).state_dict(), trained["weights"])
    for ml in ("cpu", torch.device("cpu"), {"cuda:0": "cpu"}, {"cpu": "cpu"}, lambda s, loc: s, lambda s, loc: None):
        _assert_equal(GPTModule.load_from_checkpoint(trained["dir"], map_location=ml).state_dict(), trained["weights"])
    # each form places every tensor where torch.load places the same tensors of the consolidated file
    out = tmp_path / "model.ckpt"
    assert cli_main(["consolidate", str(trained["dir"]), str(out), "--lightning", "--quiet"]) == 0
    forms = [None, "cpu", "meta", torch.device("meta"), {"cpu": "meta"}, {"cuda:0": "meta"},
             lambda s, loc: None, lambda s, loc: torch.UntypedStorage(s.nbytes(), device="meta")]
    for ml in forms:
        got = load_as_lightning_checkpoint(trained["dir"], optimizer=False, map_location=ml)["state_dict"]
        want = torch.load(out, map_location=ml)["state_dict"]
        assert sorted(got) == sorted(want)
        assert {k: v.device for k, v in got.items()} == {k: v.device for k, v in want.items()}, ml
        if want["model.lm_head.weight"].device.type == "cpu":
            _assert_equal(got, want)
        tied = [got["model.lm_head.weight"], got["model.transformer.wte.weight"]]
        assert tied[0] is tied[1] or tied[0].untyped_storage().data_ptr() == tied[1].untyped_storage().data_ptr()
    with pytest.raises(TypeError, match="map_location=3; allowed: None, a device string"):
        load_as_lightning_checkpoint(trained["dir"], optimizer=False, map_location=3)
