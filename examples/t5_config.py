"""Structured-config schema of the Hydra T5 fine-tuning recipe (``examples/t5_finetune.py``).

Design note
-----------
* Every config group (``strategy/``, ``model/``, ``data/``, ``trainer/``) is a preset of ONE dataclass
  schema registered in Hydra's ConfigStore, and the top-level :class:`T5FinetuneConf` types every field.
  Hydra therefore refuses a misspelt key (``strategy.stag=1``) or a wrong type (``strategy.stage=two``)
  while composing, before any process starts.
* Values are range-checked by the code that consumes them, once: :func:`build_strategy` constructs a
  :class:`lightning_zero.ZeroStrategy`, whose :class:`lightning_zero.ZeroConfig` refuses an unknown stage
  or an invalid offload combination with a message naming what is allowed.  The app turns that into a
  one-line "config error" before any process is launched.
* Nothing here imports transformers; :func:`build_t5_config` imports it lazily.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

@dataclass
class StrategyConf:
    """Arguments of :class:`lightning_zero.ZeroStrategy` (plus a display name)."""

    name: str = "zero2"  # label only (run names, logs); the fields below are what is built
    stage: int = 2
    # false | true (= cpu) | cpu | nvme (ZeRO-Infinity: masters + optimizer state in scratch files under nvme_path)
    offload_optimizer: Any = False
    offload_params: Any = False  # stage 3 only: false | true (= cpu) | nvme (parameter shards in scratch files)
    nvme_path: Optional[str] = None  # offload_optimizer / offload_params=nvme: an existing, writable directory (null: $LIGHTNING_ZERO_NVME_PATH)
    nvme_buffer_count: int = 3  # host buffers of the NVMe ring (>= 2)
    nvme_direct: bool = False  # O_DIRECT scratch files (the disk's DMA instead of page-cache copies)
    # the offloaded step's kernel: fused (torch's fused CPU AdamW, faster, ~1 ulp/step from DDP) | user (DDP-exact)
    offload_kernel: str = "fused"
    bucket_mb: float = 25.0
    reduce_dtype: Optional[str] = None  # null = compute dtype; "fp32" for exact fp32 reductions
    # fp32 | bf16: the optimizer's per-element state (Adam's moments) kept in bf16 between steps, each bucket
    # widened to fp32 for its step; the master in bf16 plus a bf16 Kahan compensation term (needs
    # trainer.precision=bf16-mixed). docs/ARCHITECTURE.md, "Optimizer states below fp32"
    optimizer_state_dtype: str = "fp32"
    master_dtype: str = "fp32"
    broadcast_buffers: bool = True
    # stage 3: modules gathered/released together (class names or module names); null = the model's
    # _no_split_modules (T5Block for T5), else its repeated blocks, else by size
    unit_classes: Optional[List[str]] = None
    unit_mb: Optional[float] = None  # set: units by size (MiB) instead
    persist_numel: Optional[int] = None  # units smaller than this stay gathered; null = relative to the units
    prefetch: Any = True  # stage 3: true (1 unit ahead) | false | how many units ahead (an int)
    reshard_after_forward: bool = True  # stage 3: false keeps each unit gathered from its forward to its backward
    order_check: str = "strict"  # strict | always | off
    checkpoint_format: str = "sharded"  # sharded (DCP directory) | full (one file)
    # sharded checkpoints written by a background thread: training stops only to copy the rank's share to host memory
    async_save: bool = False
    # LoRA / peft: save only what is trained, the frozen base recorded by reference (path + hash) to
    # checkpoint_base (a save_pretrained dir or a lightning_zero checkpoint; needed with it, e.g. ${model.pretrained})
    checkpoint_trainable_only: bool = False
    checkpoint_base: Optional[str] = None
    # recompute these modules' forward in backward: null | auto (the unit policy's blocks: T5Block) | [T5Block, ...]
    activation_checkpointing: Any = None
    offload_activations: bool = False  # saved activations in (pinned) host memory between forward and backward
    # communication: auto (per backend) | reduce_scatter | all_reduce | all_to_all; the stage 1-2 publish
    # overlapped with the next forward; int8 all-gathers of parameters (qwZ) and reduce-scatters of gradients (qgZ)
    grad_reduce: str = "auto"
    overlap_publish: bool = False  # true: read engine/optim/publish.py first (callbacks reading weights)
    quantize_weights: bool = False
    quantize_grads: bool = False
    # popen | spawn | fork | forkserver.  Defaults to the trainer preset's choice (cpu: fork, gpu: popen).
    start_method: str = "${trainer.start_method}"
    # hybrid sharding: shard within groups of this many consecutive ranks (a node), replicate across them;
    # null = the whole world. E.g. `strategy.shard_group_size=8` on 2 nodes x 8 GPUs
    shard_group_size: Optional[int] = None
    # tensor parallelism (stages 0-2): a (N // T, T) ("data_parallel", "tensor_parallel") mesh for a model cut with
    # parallelize_module in configure_model; null = none. The T5 recipe's model is not cut: the T ranks repeat it
    tensor_parallel_size: Optional[int] = None
    # sequence parallelism (Ulysses, any stage): groups of S consecutive ranks split each source sequence (T5's
    # encoder self-attention runs on S-th of the heads over the whole sequence); null = none
    sequence_parallel_size: Optional[int] = None


@dataclass
class SparseAttentionConf:
    """``model.attention=sparse``: the encoder's self-attention block-sparse (lightning_zero.sparse_attention)."""

    # dense | fixed | variable | bigbird | bslongformer | local: DeepSpeed's sparsity configs, same options
    layout: str = "bslongformer"
    block: int = 16  # tokens per block; lengths that are not a multiple are padded (pad_to_block)
    pad_to_block: bool = True  # false: a source length that is not a multiple of block is refused
    # the layout's own options, e.g. {num_sliding_window_blocks: 5, global_block_indices: [0]}
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelConf:
    preset: str = "t5_mini"  # a key of examples/t5_module.T5_PRESETS
    pretrained: Optional[str] = None  # LOCAL directory with config.json + weights; never downloaded
    dropout_rate: float = 0.1  # random init only (a pretrained checkpoint keeps its own config)
    num_gen_batches: Optional[int] = None  # validation batches that also run generate() (chrF/BLEU/ROUGE-L); None: all
    num_samples: int = 4  # fixed validation examples shown as text (TensorBoard + console summary)
    max_new_tokens: int = 64
    # greedy decoding never repeats an n-gram of this size (0 = off): a small model's greedy output otherwise
    # loops ("the the the ...") until max_new_tokens, as summarisation decoders commonly prevent
    no_repeat_ngram_size: int = 3
    config_overrides: Dict[str, Any] = field(default_factory=dict)  # extra T5Config fields, e.g. {d_model: 128}
    # dense: HF's attention | sparse: the encoder's self-attention block-sparse, O(n) memory in the source
    # length (with data.max_source_len=2048 and more); weights and checkpoints stay stock T5
    attention: str = "dense"
    sparse: SparseAttentionConf = field(default_factory=SparseAttentionConf)


@dataclass
class TokenizerConf:
    """Ignored with ``model.pretrained=DIR``: the checkpoint's own tokenizer (saved in DIR) is used."""

    kind: str = "subword"  # subword (BPE trained on the training split, cached) | bytes (ByT5Tokenizer)
    vocab_size: int = 2048  # subword only
    cache_dir: Optional[str] = None  # null = <data cache dir>/tokenizers


@dataclass
class DataConf:
    kind: str = "stdlib"  # "stdlib" (embedded code-summarisation set) or "file" (.jsonl/.csv of pairs)
    path: Optional[str] = None  # kind=file: the pairs file (relative paths: to the launch directory)
    source_field: str = "source"
    target_field: str = "target"
    batch_size: int = 16  # per rank
    max_source_len: int = 256  # tokens, including eos
    max_target_len: int = 64
    limit_train: Optional[int] = None  # first N training pairs (null = all)
    limit_val: Optional[int] = None  # first N validation pairs (null = all)
    num_workers: int = 0
    # prefix each source with its function's name split into words (`_check_thread` -> "check thread"): the
    # identifier split of code-summarisation models, so the summary's words can be copied as prose tokens
    name_hint: bool = True
    # kind=stdlib only
    summary: str = "sentence"  # target: the docstring's first "sentence" or first "paragraph"
    max_pairs: Optional[int] = 6000
    # functions longer than this (characters, docstring removed) are left out of the set, not truncated;
    # the long-input preset (data=stdlib_long) raises it so that whole long functions come in
    max_source_chars: int = 2000
    stdlib_packages: Optional[List[str]] = None  # restrict to top-level stdlib packages (fast tests)
    cache_dir: Optional[str] = None  # null = ~/.cache/lightning_zero/t5_data


@dataclass
class TrainerConf:
    """The Lightning ``Trainer`` arguments the recipe exposes (plus launcher/progress-bar choices)."""

    accelerator: str = "cpu"
    devices: Any = 2  # int, list or "auto"
    num_nodes: int = 1
    precision: str = "32-true"
    max_steps: int = 600
    max_epochs: int = -1
    val_check_interval: Any = 50  # int = every N training steps (with check_val_every_n_epoch null)
    check_val_every_n_epoch: Optional[int] = None
    limit_val_batches: Any = 1.0
    num_sanity_val_steps: int = 0
    log_every_n_steps: int = 10
    gradient_clip_val: Optional[float] = 1.0
    accumulate_grad_batches: int = 1
    deterministic: bool = False
    enable_progress_bar: bool = True
    progress_bar: str = "auto"  # auto (rich on a terminal, else tqdm) | rich | tqdm
    # Validate the untrained model first (a "step 0" point for the summary).  Off for mixed precision
    # in-process launchers: ZeroStrategy's evaluation path casts the module to the compute dtype in place.
    validate_before_fit: bool = False
    # Default launcher of the ZeRO strategy on this hardware (strategy.start_method interpolates it).
    start_method: str = "fork"


@dataclass
class OptimConf:
    # adamw (torch.optim.AdamW) | muon (torch.optim.Muon on the hidden matrices + AdamW on the rest; manual
    # optimization, no gradient accumulation) | adafactor (torch.optim.Adafactor): any ZeRO stage, not with NVMe
    # optimizer state (docs/optimizers.md) | onebit_adam | zeroone_adam: the communication-compressed Adams of
    # lightning_zero.optim (docs/onebit_adam.md): strategy stage 0 for both, stage 1 for onebit_adam too
    name: str = "adamw"
    # onebit_adam: AdamW steps before the variance freezes and the momentum exchange turns 1-bit;
    # zeroone_adam: its var_freeze_step. null = 20% of the run's total steps (DeepSpeed: the LR warmup's end)
    freeze_step: Optional[int] = None
    var_update_scaler: int = 16  # zeroone_adam: variance updates before its update interval doubles
    local_step_scaler: int = 32678  # zeroone_adam: steps before its local-step interval doubles
    local_step_clipper: int = 16  # zeroone_adam: the longest local-step interval
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    total_steps: Optional[int] = None  # null = the trainer's estimated stepping batches (max_steps)
    schedule: str = "linear"  # after warmup: linear (to 0 at total_steps) | cosine | inverse_sqrt (T5's)
    label_smoothing: float = 0.0  # of the training loss only (val/test loss stay the plain NLL)


@dataclass
class OutputConf:
    dir: Optional[str] = None  # null = Hydra's run directory (hydra.runtime.output_dir)
    save_top_k: int = 1
    save_last: bool = True
    tensorboard: bool = True  # also log to TensorBoard when the package is importable
    export_hf: bool = True  # write <output>/hf_model: save_pretrained model + tokenizer (AutoTokenizer loads it)
    predictions: Optional[str] = None  # mode=test: predictions JSONL (null = <output>/test_predictions.jsonl)


@dataclass
class T5FinetuneConf:
    strategy: StrategyConf = field(default_factory=StrategyConf)
    model: ModelConf = field(default_factory=ModelConf)
    tokenizer: TokenizerConf = field(default_factory=TokenizerConf)
    data: DataConf = field(default_factory=DataConf)
    trainer: TrainerConf = field(default_factory=TrainerConf)
    optim: OptimConf = field(default_factory=OptimConf)
    output: OutputConf = field(default_factory=OutputConf)
    seed: int = 0
    mode: str = "fit"  # fit (train, validate, export) | test (test metrics + predictions JSONL of ckpt_path)
    ckpt_path: Optional[str] = None  # mode=fit: resume this checkpoint (exact, mid-epoch too); mode=test: test it (null = the model as configured)


@dataclass
class PretrainConf:
    """Span corruption of examples/t5_pretrain.py (t5_pretrain_data.py)."""

    chunk_len: int = 64  # tokens per chunk before corruption (input ~0.85x + one sentinel per span + eos)
    noise_density: float = 0.15
    mean_span: float = 3.0
    val_every: int = 50  # every N-th chunk is held out for the pretraining val_loss
    max_val: int = 256


@dataclass
class T5PretrainConf(T5FinetuneConf):
    pretrain: PretrainConf = field(default_factory=PretrainConf)


def register_configs() -> None:
    """Register the schemas (idempotent).  YAML presets start with ``defaults: [/schema/<group>/<group>@_here_, _self_]``."""
    cs = ConfigStore.instance()
    cs.store(name="t5_finetune_schema", node=T5FinetuneConf)
    cs.store(name="t5_pretrain_schema", node=T5PretrainConf)
    for group, node in (("strategy", StrategyConf), ("model", ModelConf), ("tokenizer", TokenizerConf),
                        ("data", DataConf), ("trainer", TrainerConf)):
        cs.store(group=f"schema/{group}", name=group, node=node)


register_configs()


# --------------------------------------------------------------------------- builders
class ConfigError(ValueError):
    """A composed config that type-checks but cannot be built; the message says what is allowed."""


def _strategy_node(cfg: Any) -> Any:
    return cfg.strategy if isinstance(cfg, DictConfig) and "strategy" in cfg else cfg


def validate_schema(cfg: Any, schema: type = T5FinetuneConf, _path: str = "") -> None:
    """Refuse keys the schema does not know and, for the whole config, numbers out of their range
    (``t5_ranges.RANGES``): one ``ConfigError`` before any process starts.

    Composition already refuses ``strategy.stag=1``, but Hydra's append syntax (``+strategy.stag=1``) opens
    the struct flag and would smuggle the key in (and OmegaConf.merge onto the schema lets it through too),
    so walk the dataclass fields explicitly.
    """
    import dataclasses

    if not isinstance(cfg, DictConfig):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    unknown = sorted(set(cfg.keys()) - set(fields) - {"hydra"})
    if unknown:
        where = _path.rstrip(".") or "the top level"
        raise ConfigError(f"Unknown config key(s) {', '.join(_path + k for k in unknown)} in {where} "
                          f"(schema {schema.__name__}, examples/t5_config.py). "
                          f"Allowed: {', '.join(fields)}.")
    for name, f in fields.items():
        sub = cfg._get_node(name) if name in cfg else None
        factory = f.default_factory  # annotations are strings here (__future__), so use the factory
        if isinstance(sub, DictConfig) and factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
            validate_schema(sub, factory, f"{_path}{name}.")
    if not _path:  # the whole config: values of the right type out of their range, all named at once
        from t5_ranges import check_ranges

        bad = check_ranges(cfg)
        if bad:
            raise ConfigError(f"Out of range: {'; '.join(bad)}.")


def strategy_kwargs(cfg: Any) -> dict:
    """``ZeroStrategy`` keyword arguments from ``cfg`` (the whole config or its ``strategy`` node)."""
    s = _strategy_node(cfg)
    validate_schema(s, StrategyConf, "strategy." if s is not cfg else "")
    s = OmegaConf.to_container(s, resolve=True) if isinstance(s, DictConfig) else dict(vars(s))
    s.pop("name", None)
    return s


def build_strategy(cfg: Any):
    """Construct the :class:`lightning_zero.ZeroStrategy` described by ``cfg.strategy``.

    Raises :class:`ConfigError` (a ``ValueError``) naming the preset, the offending values and what is
    allowed, e.g. for ``strategy.stage=5`` or ``strategy.offload_optimizer=true`` with stage 0.
    """
    from lightning_zero import ZeroStrategy

    kwargs = strategy_kwargs(cfg)
    name = _strategy_node(cfg).get("name", "?")
    try:
        return ZeroStrategy(**kwargs)
    except ValueError as e:  # lightning_zero's message names what is allowed; add where it came from
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ConfigError(f"Invalid strategy config (strategy={name}: {shown}): {e}") from e


def build_t5_config(cfg: Any, tokenizer: Any = None):
    """``transformers.T5Config`` of a ``model`` preset (random-init architecture, the tokenizer's vocab)."""
    m = cfg.model if isinstance(cfg, DictConfig) and "model" in cfg else cfg
    from t5_module import make_t5_config

    try:
        overrides = OmegaConf.to_container(m.config_overrides, resolve=True) if m.config_overrides else {}
        return make_t5_config(m.preset, tokenizer, dropout_rate=m.dropout_rate, **overrides)
    except ValueError as e:
        raise ConfigError(f"Invalid model config (model.preset={m.preset!r}): {e}") from e


def build_tokenizer(cfg: Any, train_pairs: list[dict]):
    """The run's tokenizer: DIR's own with ``model.pretrained=DIR``, else ``cfg.tokenizer``.

    The subword BPE is trained on the training split's sources and targets (never val/test), cached.
    """
    from t5_tokenizer import (TOKENIZER_KINDS, bytes_tokenizer, cached_subword_tokenizer,
                              load_tokenizer_dir)

    pretrained = cfg.model.pretrained
    if pretrained:
        path = _absolute(pretrained)
        from t5_module import check_local_model_dir

        try:
            check_local_model_dir(path)
        except FileNotFoundError as e:
            raise ConfigError(f"model.pretrained: {e}") from e
        if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            raise ConfigError(f"model.pretrained={pretrained!r} holds no tokenizer (tokenizer.json / "
                              "tokenizer_config.json): save the tokenizer the weights were trained with into it "
                              "(tokenizer.save_pretrained(DIR); t5_pretrain.py does).")
        return load_tokenizer_dir(path)
    t = cfg.tokenizer
    if t.kind == "bytes":
        return bytes_tokenizer()
    if t.kind == "subword":
        texts = [p["source"] for p in train_pairs] + [p["target"] for p in train_pairs]
        if not texts:
            raise ConfigError("tokenizer=subword trains on the training split, which is empty.")
        cache = t.cache_dir or os.path.join(cfg.data.cache_dir or default_cache_dir(), "tokenizers")
        try:
            return cached_subword_tokenizer(texts, t.vocab_size, _absolute(cache))
        except ValueError as e:
            raise ConfigError(str(e)) from e
    raise ConfigError(f"Unknown tokenizer.kind {t.kind!r}. Allowed: {', '.join(TOKENIZER_KINDS)}.")


def default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                        "lightning_zero", "t5_data")


def build_datamodule(cfg: Any, tokenizer: Any = None):
    """``Seq2SeqDataModule`` for the ``data`` preset (paths resolved against the launch directory)."""
    from t5_data import Seq2SeqDataModule

    d = cfg.data
    common = dict(tokenizer=tokenizer, batch_size=d.batch_size, max_source_len=d.max_source_len,
                  max_target_len=d.max_target_len, num_workers=d.num_workers,
                  limit_train=d.limit_train, limit_val=d.limit_val, name_hint=d.name_hint)
    if d.kind == "stdlib":
        if d.max_source_chars < 1:
            raise ConfigError(f"data.max_source_chars must be an int >= 1 (the longest function, in characters, the "
                              f"set keeps); got {d.max_source_chars!r}.")
        stdlib_kwargs = dict(seed=cfg.seed, max_pairs=d.max_pairs, cache_dir=d.cache_dir or default_cache_dir(),
                             summary=d.summary, max_source_chars=d.max_source_chars)
        if d.stdlib_packages:
            stdlib_kwargs["packages"] = tuple(d.stdlib_packages)
        return Seq2SeqDataModule("stdlib", stdlib_kwargs=stdlib_kwargs, **common)
    if d.kind == "file":
        if not d.path:
            raise ConfigError("data=jsonl needs a pairs file: pass data.path=/path/to/pairs.jsonl "
                              "(one JSON object per line, or a .csv with a header row).")
        path = _absolute(d.path)
        if not os.path.isfile(path):
            raise ConfigError(f"data.path={d.path!r}: no such file ({path}).")
        return Seq2SeqDataModule(path, source_field=d.source_field, target_field=d.target_field, **common)
    raise ConfigError(f"Unknown data.kind {d.kind!r}. Allowed: 'stdlib', 'file'.")


def _absolute(path: str) -> str:
    """Relative paths are relative to where the app was launched (Hydra's original cwd)."""
    path = os.path.expanduser(path)
    if os.path.isabs(path):
        return path
    try:
        from hydra.utils import to_absolute_path

        return to_absolute_path(path)
    except ValueError:  # HydraConfig not initialised (compose API, plain Python)
        return os.path.abspath(path)


def tune_model_config(cfg: Any):
    """The model ``lightning-zero tune`` measures (its recipe interface, ``TuneRecipe``): the checkpoint's own
    config with ``model.pretrained=DIR``, else this recipe's T5 preset with the vocabulary of the run's
    tokenizer -- 384 for ``tokenizer=bytes`` (ByT5), else the BPE's ``tokenizer.vocab_size`` -- without
    training it (pad 0 / eos 1, as every recipe tokenizer)."""
    m = cfg.model
    if m.pretrained:
        from transformers import T5Config

        from t5_module import check_local_model_dir

        try:
            return T5Config.from_pretrained(str(check_local_model_dir(_absolute(m.pretrained))), local_files_only=True)
        except FileNotFoundError as e:
            raise ConfigError(f"model.pretrained: {e}") from e
    if cfg.tokenizer.kind == "bytes":
        from t5_tokenizer import bytes_tokenizer, tokenizer_vocab

        vocab = tokenizer_vocab(bytes_tokenizer())
    else:
        vocab = int(cfg.tokenizer.vocab_size)
    overrides = OmegaConf.to_container(m.config_overrides, resolve=True) if m.config_overrides else {}
    from t5_module import make_t5_config

    try:
        return make_t5_config(m.preset, None, dropout_rate=m.dropout_rate, **{"vocab_size": vocab, **overrides})
    except ValueError as e:
        raise ConfigError(f"Invalid model config (model.preset={m.preset!r}): {e}") from e
