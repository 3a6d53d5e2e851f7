"""`lightning-zero estimate` as a user types it: every size knob refused when it is not positive (one error
naming the flag and what is allowed, no table), unknown settings refused, and model names in HF's spelling as
well as ours."""

from __future__ import annotations

import pytest

from lightning_zero.tools.cli import main as cli_main
from lightning_zero.tools.estimate import estimate_model_states
from lightning_zero.tools.estimate_pipeline import estimate_pipeline

SETTINGS_ALLOWED = ("Allowed: a comma list of zero0, zero1, zero1_offload, zero2, zero2_offload, zero3, zero3_offload, "
                    "zero2_offload_nvme, zero3_offload_nvme")


@pytest.mark.parametrize("argv, allowed", [
    (["--ranks", "-2"], "world_size=-2 (--ranks): allowed an int >= 1"),
    (["--ranks", "0"], "world_size=0 (--ranks): allowed an int >= 1"),
    (["--nodes", "-1"], "num_nodes=-1 (--nodes): allowed an int >= 1"),
    (["--ranks", "4", "--nodes", "3"], "world_size (4) must be a multiple of num_nodes (3)"),
    (["--bucket-mb", "-5"], "bucket_mb=-5.0 (--bucket-mb): allowed a positive, finite number"),
    (["--bucket-mb", "nan"], "bucket_mb=nan (--bucket-mb): allowed a positive, finite number"),
    (["--grad-accum", "0"], "grad_accumulation=0 (--grad-accum): allowed an int >= 1"),
    (["--batch-size", "-4"], "batch_size=-4 (--batch-size): allowed None or an int >= 1"),
    (["--batch-size", "0"], "batch_size=0 (--batch-size): allowed None or an int >= 1"),
    (["--src-len", "-3"], "src_len=-3 (--src-len): allowed an int >= 1"),
    (["--tgt-len", "0"], "tgt_len=0 (--tgt-len): allowed an int >= 1"),
    (["--device-memory", "-1"], "device_memory_gb=-1.0 (--device-memory): allowed None or a positive, finite number"),
    (["--device-memory", "8", "--cpu-memory", "-2"], "cpu_memory_gb=-2.0 (--cpu-memory): allowed None or a positive"),
    (["--cpu-memory", "5"], "cpu_memory_gb (--cpu-memory) without device_memory_gb (--device-memory). Allowed: "
                            "--device-memory alone, or both"),
    (["--step-time", "0"], "nvme_step_time=0.0 (--step-time): allowed a positive, finite number"),
    (["--step-time", "-1"], "nvme_step_time=-1.0 (--step-time): allowed a positive, finite number"),
    (["--vocab", "-3"], "vocab_size=-3 (--vocab): allowed None or an int >= 1"),
    (["--vocab", "big"], "--vocab 'big': allowed 'preset'"),
    (["--params", "-5"], "parameter count '-5' (--params): allowed a positive count, e.g. 1.5e9"),
    (["--params", "0"], "parameter count '0' (--params): allowed a positive count"),
    (["--params", "abc"], "parameter count 'abc' (--params): allowed a positive count"),
    (["--probe-batch-size", "-1"], "probe_batch=-1 (--probe-batch-size): allowed an int >= 1"),
    (["--optimizer", "lion"], "Unknown optimizer 'lion' for the memory estimate. Allowed: adam, adamw"),
    (["--settings", "zero9"], f"settings (--settings): unknown 'zero9'. {SETTINGS_ALLOWED}"),
    (["--settings", "zero2,,zero3"], f"settings (--settings): unknown ''. {SETTINGS_ALLOWED}"),
    (["--model", "t5-huge"], "T5 model 't5-huge': unknown preset. Allowed: t5_tiny, t5_mini, t5_small, t5_base, "
                             "t5_large, t5_3b (or HF's spelling: t5-tiny"),
    (["--microbatches", "4"], "--microbatches and --stage-params describe a pipeline. Allowed: with "
                              "--pipeline-parallel-size P"),
    (["--pipeline-parallel-size", "2", "--ranks", "2", "--microbatches", "-1"],
     "microbatches=-1 (--microbatches): allowed None or an int >= 1"),
    (["--pipeline-parallel-size", "2", "--ranks", "2", "--microbatches", "0"],
     "microbatches=0 (--microbatches): allowed None or an int >= 1"),
    (["--pipeline-parallel-size", "2", "--ranks", "-2"], "world_size=-2 (--ranks): allowed an int >= 1"),
    (["--shard-group-size", "-2"], "shard_group_size must be an int >= 1 that divides the world size"),
    (["--tensor-parallel-size", "0"], "tensor_parallel_size must be an int >= 1 that divides the world size"),
    (["--pipeline-parallel-size", "0"], "pipeline_parallel_size=0 does not divide the world of 1 rank(s) into "
                                        "pipelines of equal length. Allowed: 1"),
    (["--pipeline-parallel-size", "2", "--ranks", "2", "--stage-params=-1,5"],
     "parameter count '-1' (--stage-params): allowed a positive count"),
])
def test_bad_estimate_knobs_are_one_error_naming_what_is_allowed(argv, allowed, capsys):
    assert cli_main(["estimate", *argv]) == 2
    out, err = capsys.readouterr()
    assert f"lightning-zero estimate: error: {allowed}" in err, err
    assert "Traceback" not in err and "|" not in out  # no table, no half-computed output


@pytest.mark.parametrize("kwargs, allowed", [
    (dict(world_size=-1), "world_size=-1 (--ranks): allowed an int >= 1"),
    (dict(world_size=2.5), "world_size=2.5 (--ranks): allowed an int >= 1"),
    (dict(batch_size=-4), "batch_size=-4 (--batch-size)"),
    (dict(settings=["zero9"]), SETTINGS_ALLOWED),
    (dict(settings=[]), "none given. " + SETTINGS_ALLOWED),
    (dict(nvme_step_time=0.0), "nvme_step_time=0.0 (--step-time)"),
    (dict(bucket_mb=float("inf")), "bucket_mb=inf (--bucket-mb)"),
])
def test_bad_knobs_of_the_python_api_are_refused_the_same_way(kwargs, allowed):
    with pytest.raises(ValueError, match=allowed.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        estimate_model_states("t5_small", **kwargs)
    with pytest.raises(ValueError, match="a positive parameter count"):
        estimate_model_states(-5)


def test_pipeline_estimate_refuses_zero_microbatches():
    with pytest.raises(ValueError, match=r"microbatches=0 \(--microbatches\): allowed None or an int >= 1"):
        estimate_pipeline(10**6, 2, 2, microbatches=0)


@pytest.mark.parametrize("name", ["t5-3b", "T5_3B", "T5-3B", "google-t5/t5-3b", "t5_3b"])
def test_hf_model_names_are_the_same_preset(name, capsys):
    assert cli_main(["estimate", "--model", "t5_3b", "--ranks", "8", "--batch-size", "2"]) == 0
    ours = capsys.readouterr().out
    assert cli_main(["estimate", "--model", name, "--ranks", "8", "--batch-size", "2"]) == 0
    assert capsys.readouterr().out == ours
    assert estimate_model_states(name, world_size=8).info.numel == estimate_model_states("t5_3b", 8).info.numel


@pytest.mark.parametrize("name", ["t5-small", "T5_SMALL", "google-t5/t5-small"])
def test_the_recipe_takes_hf_model_names_too(name):
    from tests.helpers.hydra_recipe import compose_recipe  # noqa: F401  (puts examples/ on sys.path)
    from t5_config import build_t5_config

    theirs = build_t5_config(compose_recipe(f"model.preset={name}"))
    ours = build_t5_config(compose_recipe("model.preset=t5_small"))
    assert theirs.to_dict() == ours.to_dict()
