"""Sequence parallelism under the Trainer, exact against plain DDP on whole sequences.

``ZeroStrategy(sequence_parallel_size=S)`` on D * S forked gloo ranks against Lightning's own DDP on D ranks (one
process for D = 1), same seed and data: each sequence-parallel rank's logged loss is the whole sequence's and equals
its data-parallel replica's loss in the reference, step by step, and the final weights agree (fp32, rtol 1e-5).
The models are HF GPT-2 and Llama built from their configs; the batches are dicts as a tokenizer's collator makes
them (``input_ids``, ``attention_mask``, ``labels``), cut by the strategy, never by the test.
"""

from __future__ import annotations

import itertools

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeroStrategy
from tests.helpers.parity import FP32, SP_FP32, close
from tests.helpers.sp_lightning import SPModule, make_lm, rank_files, trainer_kwargs

_RUN = itertools.count()
STEPS = 4


def _fit(tmp_path, strategy, devices, kind="gpt2", steps=STEPS, accum=1, clip=None, ckpt=None, callbacks=(),
         **module_kw):
    tag = f"run{next(_RUN)}_"
    model = SPModule(kind, str(tmp_path), tag, **module_kw)
    trainer = Trainer(strategy=strategy, callbacks=list(callbacks),
                      **trainer_kwargs(devices, steps, accum, clip, enable_checkpointing=bool(callbacks)))
    trainer.fit(model, ckpt_path=ckpt)
    return rank_files(str(tmp_path), tag, devices)


def _reference(tmp_path, replicas, **kw):
    """Lightning's plain DDP on ``replicas`` ranks (one included: the same shuffled DistributedSampler, which
    Lightning puts on every distributed training loader)."""
    return _fit(tmp_path, DDPStrategy(start_method="fork"), replicas, **kw)


def _compare(sp: list[dict], ref: list[dict], size: int, kind: str = "gpt2") -> None:
    """Sequence-parallel rank r against the reference's data-parallel rank r // S."""
    assert len(sp) == len(ref) * size
    for rank, got in enumerate(sp):
        want = ref[rank // size]
        assert got["step"] == want["step"]
        close(got["losses"], want["losses"], f"rank {rank} losses", FP32)
        close(got["params"], want["params"], f"rank {rank} weights", SP_FP32)
    untrained = make_lm(kind).lm_head.weight.detach()  # the run trained
    assert not ref[0]["params"]["model.lm_head.weight"].equal(untrained)


def _zero(stage, size, **kw):
    return ZeroStrategy(stage=stage, sequence_parallel_size=size, start_method="fork", **kw)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gpt2_two_way_equals_one_process_on_the_whole_sequence(tmp_path, stage):
    ref = _reference(tmp_path, 1)
    _compare(_fit(tmp_path, _zero(stage, 2), 2), ref, 2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind, stage", [("llama", 2), ("gpt2", 3)])
def test_four_way_equals_one_process(tmp_path, kind, stage):
    ref = _reference(tmp_path, 1, kind=kind)
    _compare(_fit(tmp_path, _zero(stage, 4), 4, kind=kind), ref, 4, kind)


@pytest.mark.timeout(300)
def test_llama_two_way_over_two_replicas_at_stage_3_equals_ddp(tmp_path):
    """D = 2 groups of S = 2: parameters, gradients and optimizer state sharded over all four ranks."""
    ref = _reference(tmp_path, 2, kind="llama", padded=True)
    _compare(_fit(tmp_path, _zero(3, 2), 4, kind="llama", padded=True), ref, 2, "llama")


@pytest.mark.timeout(300)
def test_hybrid_sharding_with_sequence_groups_equals_ddp(tmp_path):
    """Shard groups of 2 ranks replicated twice, sequence groups of 2: the two dims cut the same four ranks."""
    ref = _reference(tmp_path, 2)
    _compare(_fit(tmp_path, _zero(3, 2, shard_group_size=2), 4), ref, 2)


@pytest.mark.timeout(300)
def test_accumulation_and_clipping_with_padding(tmp_path):
    ref = _reference(tmp_path, 1, accum=2, clip=0.05, padded=True)
    _compare(_fit(tmp_path, _zero(2, 2), 2, accum=2, clip=0.05, padded=True), ref, 2)


@pytest.mark.timeout(300)
def test_block_sparse_attention_on_the_head_shards(tmp_path):
    ref = _reference(tmp_path, 1, sparse=True)
    _compare(_fit(tmp_path, _zero(3, 2), 2, sparse=True), ref, 2)


@pytest.mark.timeout(300)
def test_offloaded_stage_3(tmp_path):
    ref = _reference(tmp_path, 1)
    _compare(_fit(tmp_path, _zero(3, 2, offload_optimizer=True, offload_params=True), 2), ref, 2)


@pytest.mark.timeout(400)
def test_checkpoint_resumes_at_another_sequence_parallel_size(tmp_path):
    """Saved at S = 2 after an epoch (3 steps of 6 items), resumed at S = 4 and at S = 1 (one data-parallel replica
    throughout): both equal the uninterrupted single-process run."""
    ref = _reference(tmp_path, 1, steps=6, n_items=6)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    _fit(tmp_path, _zero(3, 2), 2, steps=3, n_items=6, callbacks=[saver])
    path = str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
    for size, devices in ((4, 4), (1, 1)):
        got = _fit(tmp_path, _zero(2, size) if devices > 1 else ZeroStrategy(stage=2, sequence_parallel_size=1),
                   devices, steps=6, n_items=6, ckpt=path)
        for rank, g in enumerate(got):
            close(g["losses"], ref[0]["losses"][3:], f"S={size} rank {rank} losses after the resume", FP32)
            close(g["params"], ref[0]["params"], f"S={size} rank {rank} weights", SP_FP32)


def test_a_size_that_does_not_divide_the_world_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"sequence_parallel_size=4 does not divide the world of 2 rank\(s\) into "
                                         r"equal sequence-parallel groups\. Allowed: 1, 2\."):
        Trainer(strategy=_zero(2, 4), accelerator="cpu", devices=2)


class _TwoHeads(SPModule):
    def configure_model(self) -> None:  # a GPT-2 of 2 heads: four ranks cannot split it
        import transformers

        self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=32,
                                                                          n_layer=1, n_head=2))


@pytest.mark.timeout(120)
def test_heads_the_group_cannot_split_are_refused_naming_the_module(tmp_path):
    trainer = Trainer(strategy=_zero(2, 4), **trainer_kwargs(4, 1))
    with pytest.raises(Exception, match=r"transformer\.h\.0\.attn \(GPT2Attention\) has 2 attention heads.*"
                                        r"allowed sizes: \[1, 2\]"):
        trainer.fit(_TwoHeads("gpt2", str(tmp_path), "heads_"))


def _two_modules(rank, world):
    """A strategy's layout over two LightningModules in one process, as a second fit (torchrun) builds it."""
    import torch
    from torch.utils.data import DataLoader

    from lightning_zero.lightning.sequence_parallel import SequenceParallelLayout
    from tests.helpers.sp_lightning import Tokens

    torch.set_num_threads(1)
    layout = SequenceParallelLayout(world)
    layout.build()
    batch = next(iter(DataLoader(Tokens(4, False), batch_size=2)))
    losses = []
    for _ in range(2):
        module = SPModule("gpt2", "", "")
        layout.apply(module)
        layout.apply(module)  # every entry point of the Trainer applies it again
        losses.append(float(module.model(**layout.shard(batch)).loss))
    return losses


@pytest.mark.timeout(120)
def test_a_second_module_in_the_same_process_is_split_too():
    import torch
    from torch.utils.data import DataLoader

    from tests.helpers.dist_utils import run_distributed
    from tests.helpers.sp_lightning import Tokens

    want = float(make_lm("gpt2")(**next(iter(DataLoader(Tokens(4, False), batch_size=2)))).loss)
    for rank, losses in enumerate(run_distributed(_two_modules, 2)):
        close(torch.tensor(losses), torch.tensor([want, want]), f"rank {rank} losses", FP32)
