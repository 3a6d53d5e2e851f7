"""``lightning-zero export CKPT OUTDIR --hf``: a checkpoint directory as a ``save_pretrained`` directory
(``model.safetensors`` + ``config.json``) that ``AutoModel...from_pretrained(OUTDIR)`` loads with nothing
missing and nothing unexpected.

Design note
-----------
The checkpoint's names are the LightningModule's (``model.transformer.h.0...``); the HF class's are its own
(``transformer.h.0...``). The prefix between them is given (``--prefix model.``) or found: the one prefix
under which the checkpoint holds every key the HF class built from the config expects. The key sets are
then compared exactly -- before anything is written -- because ``from_pretrained`` itself only warns about
missing keys and leaves them randomly initialized. The class is the config's ``architectures``, else the
first of the causal-LM / seq2seq / masked-LM / base classes whose keys the checkpoint holds exactly (a
GPT-2 LM head model is not silently exported as its base ``GPT2Model``: the head would be unexpected).
Classes are built on the meta device (no memory); tied weights are written once, under their source name,
as ``save_pretrained`` does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

from ..checkpoint import trainable_only as TO, trainable_parts as TP
from ..checkpoint.consolidate import save_state, stored_nbytes, write_safetensors
from ..checkpoint.files import META_FILE, read_info, read_meta, resolve_checkpoint_dir
from ..checkpoint.trust import UntrustedCheckpointError

_WEIGHTS = "model.safetensors"


def load_config(config: Optional[str], meta: dict) -> Any:
    """``--config`` (a directory with config.json, or a json file), else a ``PretrainedConfig`` (or a dict
    with ``model_type``) among the saved hyper-parameters."""
    from transformers import AutoConfig, PretrainedConfig

    if config is not None:
        p = Path(config)
        if not p.exists():
            raise FileNotFoundError(f"--config {config!r}: no such file or directory (a directory holding "
                                    "config.json, or a config json file).")
        if p.is_file():  # AutoConfig wants a directory or a hub name; a bare json file goes through its class
            d = json.loads(p.read_text())
            if "model_type" not in d:
                raise ValueError(f"--config {config!r} has no 'model_type': not a transformers config.json.")
            return AutoConfig.for_model(**d)
        return AutoConfig.from_pretrained(str(p))
    hparams = meta.get("hyper_parameters") or {}
    found = [v for v in hparams.values() if isinstance(v, PretrainedConfig)]
    found += [AutoConfig.for_model(**v) for v in hparams.values() if isinstance(v, dict) and "model_type" in v]
    if len(found) != 1:
        what = "no transformers config" if not found else f"{len(found)} transformers configs"
        raise ValueError(f"The checkpoint's hyper-parameters hold {what}; pass --config DIR_or_config.json "
                         "(the config.json the model was built from).")
    return found[0]


def _meta(path: Path, trust_checkpoint: bool) -> dict:
    try:
        return read_meta(path, trust_checkpoint=trust_checkpoint)
    except UntrustedCheckpointError as err:  # e.g. a PretrainedConfig object among the hparams
        raise UntrustedCheckpointError(f"{err} Or pass --config (the model's config.json): then {META_FILE} is "
                                       "not read at all.") from None


_AUTO_HEADS = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM", "AutoModel")


def _model_classes(config: Any) -> list:
    """The config's ``architectures``, else every class of the common auto mappings for its type (a
    config built in code usually names none; the checkpoint's keys then decide, see :func:`_match`)."""
    import transformers

    named = [getattr(transformers, n) for n in getattr(config, "architectures", None) or [] if hasattr(transformers, n)]
    if named:
        return named
    found = []
    for auto in _AUTO_HEADS:
        mapping = getattr(transformers, auto)._model_mapping
        if type(config) in mapping and mapping[type(config)] not in found:
            found.append(mapping[type(config)])
    if not found:
        raise ValueError(f"No transformers model class for {type(config).__name__}; set 'architectures' in the config.")
    return found


def _expected_keys(cls, config: Any) -> tuple[dict[str, list[int]], dict[str, str]]:
    """({state-dict key from_pretrained fills: its shape}, {tied target: its source}), built on meta."""
    with torch.device("meta"):
        model = cls(config)
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None)
    tied = dict(tied) if isinstance(tied, dict) and getattr(config, "tie_word_embeddings", True) else {}
    return {k: list(t.shape) for k, t in model.state_dict().items()}, tied


def find_prefix(names: list[str], expected, tied: dict[str, str]) -> str:
    """The one prefix under which ``names`` hold every expected key (tied targets may be absent)."""
    required = [k for k in expected if k not in tied]
    candidates = {n[: len(n) - len(k)] for k in required[:1] for n in names if n == k or n.endswith("." + k)}
    full = sorted(p for p in candidates if all(p + k in set(names) for k in required))
    if len(full) == 1:
        return full[0]
    if not full:
        raise ValueError(f"No prefix of the checkpoint's names holds the {len(required)} keys of this model "
                         f"class (first: {required[0]!r}; checkpoint names start {sorted(names)[:3]}); pass "
                         "--prefix, e.g. --prefix model. for a LightningModule holding the model as self.model.")
    raise ValueError(f"Several prefixes hold every key of this model class: {full}; choose one with --prefix.")


def _match(cls, cfg, names: list[str], info: dict, prefix: Optional[str]) -> tuple[str, dict, list[str]]:
    """(prefix, {HF key: checkpoint name} to write, problems): nothing may be missing, unexpected or
    mis-shaped under the prefix."""
    expected, tied = _expected_keys(cls, cfg)
    if prefix is None:
        prefix = find_prefix(names, expected, tied)
    ours = {n[len(prefix):]: n for n in names if n.startswith(prefix)}
    missing = [k for k in expected if k not in ours and not (k in tied and tied[k] in ours)]
    unexpected = [k for k in ours if k not in expected]
    shape = {k: info["tensors"][info["aliases"].get(n, n)]["shape"] for k, n in ours.items()}
    mismatched = [f"{k}: checkpoint {tuple(shape[k])}, model {tuple(expected[k])}"
                  for k in ours if k in expected and shape[k] != expected[k]]
    problems = [f"{len(v)} {what}: {', '.join(v[:10])}{' ...' if len(v) > 10 else ''}"
                for what, v in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched))
                if v]
    # tied weights are written once, under their source name, as save_pretrained does
    return prefix, {k: ours[k] for k in expected if k in ours and not (k in tied and tied[k] in ours)}, problems


def export_hf(ckpt_dir: str, out_dir: str, prefix: Optional[str] = None, config: Optional[str] = None,
              dtype: torch.dtype = torch.float32, quiet: bool = False, trust_checkpoint: bool = False,
              adapter: bool = False) -> dict:
    """Write ``out_dir`` (model.safetensors + config.json); raise ValueError listing every missing or
    unexpected key (under the prefix) before anything is written. The checkpoint's ``meta.pt`` is read
    only without ``config``, restricted unless ``trust_checkpoint`` (checkpoint/trust.py). A trainable-only
    checkpoint ([Note: trainable-only checkpoints]) exports merged (its LoRA folded into the base it
    records), or with ``adapter`` as peft's adapter directory alone."""
    from .progress import byte_progress

    path = resolve_checkpoint_dir(ckpt_dir)
    info = read_info(path, trust_checkpoint)
    if adapter:
        return _export_adapter(path, info, out_dir, dtype, trust_checkpoint)
    entry = TO.entry_of(info)
    if config is None and entry and (Path(entry["base"]["source"]) / "config.json").is_file():
        config = entry["base"]["source"]  # a trainable-only checkpoint's base: the config its model was built from
    cfg = load_config(config, {} if config is not None else _meta(path, trust_checkpoint))
    # a trainable-only checkpoint: its LoRA folded into the base read from its source (in memory), else whole
    whole = TP.part_state(path, info, "merged" if entry["lora"] else "full", dtype,
                          trust_checkpoint=trust_checkpoint) if entry else None
    if whole is not None:
        info = {"tensors": {n: {"shape": list(t.shape)} for n, t in whole.items()}, "aliases": {}, "order": list(whole)}
    names = [n for n in info["order"] if n in info["tensors"] or n in info["aliases"]]
    tried = []
    for cls in _model_classes(cfg):
        try:
            found, written, problems = _match(cls, cfg, names, info, prefix)
        except ValueError as err:  # no prefix fits this class
            tried.append((cls, str(err)))
            continue
        if not problems:
            break
        tried.append((cls, f"The checkpoint under prefix {found!r} does not match {cls.__name__} built from the "
                           f"config: {'; '.join(problems)}. Check --prefix and --config."))
    else:
        raise ValueError(tried[0][1] if len(tried) == 1 else
                         " | ".join(f"{c.__name__}: {e}" for c, e in tried))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sources = {info["aliases"].get(n, n) for n in written.values()}
    total = 0 if whole is not None else sum(stored_nbytes({"tensors": {n: info["tensors"][n]}}, dtype) for n in sources)
    if whole is not None:
        save_state({k: whole[n] for k, n in written.items()}, out / _WEIGHTS, safetensors=True)
        res = {"tensors": len(written), "bytes": sum(whole[n].numel() * whole[n].element_size() for n in sources)}
    else:
        with byte_progress(total, f"export {out.name}", quiet) as progress:
            res = write_safetensors(out / _WEIGHTS, path, info, written, dtype, progress, trust_checkpoint)
    cfg.architectures = [cls.__name__]  # what AutoModel...from_pretrained and from_pretrained(OUTDIR) build
    if dtype != torch.float32:
        cfg.dtype = str(dtype).removeprefix("torch.")
    cfg.save_pretrained(str(out))
    return {**res, "prefix": found, "class": cls.__name__, "out": os.fspath(out)}



def _export_adapter(path: Path, info: dict, out_dir: str, dtype: torch.dtype, trust_checkpoint: bool) -> dict:
    """``--adapter``: peft's ``save_pretrained`` directory of the trained adapter (no base read, no peft needed)."""
    entry = TP.check_part("adapter", info, path)
    tensors, config = TP.peft_adapter(TP.part_state(path, info, "adapter", dtype, trust_checkpoint=trust_checkpoint),
                                      entry)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_state(tensors, out / "adapter_model.safetensors", safetensors=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "prefix": "base_model.model.", "class": "PeftModel", "out": os.fspath(out)}
