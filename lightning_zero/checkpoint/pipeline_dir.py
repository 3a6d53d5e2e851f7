"""Pipeline checkpoints: one ZeRO checkpoint directory per (virtual) stage, inside one atomic directory.

Design note
-----------
::

    ckpt/                      (written as ckpt.zero-tmp, renamed when complete: format.py's atomic rename)
      zero_checkpoint.json     the manifest: format "lightning_zero.pipeline" version 2; P, chunks per rank,
                               the data-parallel size and ZeRO stage at save; per stage its directory, its
                               parameter count and ``source_names`` (stage-local name -> name in the uncut model)
      meta.pt                  the caller's metadata (Lightning's loops, LR schedulers, callbacks, ...)
      stage0/ ... stage<S-1>/  each exactly what a ZeRO engine over D ranks writes (format.py's files), written
                               by that stage's data-parallel group alone (``dcp.save(process_group=dp_group)``):
                               masters and optimizer state as flat DTensor shards on the group's mesh, each rank
                               writing its own slice, nothing gathered; plus the stage's loss scaler and skips

Because a stage's directory is an ordinary sharded checkpoint, loading reshards as for ZeRO: each stage's
data-parallel group reads its own directory through DCP's metadata, D -> D' ranks and ZeRO stage a -> b
alike. The pipeline's shape (P stages x chunks per rank) must match; any other shape goes through
:func:`consolidate_pipeline_checkpoint` (one process, no process group), the uncut model's state dict.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from ..engine.comm.collectives import rank as _rank
from ..engine.engine_state import EngineMode
from ..engine.pipeline.state import source_names
from . import integrity
from .consolidate import atomic_output, full_model_state
from .files import FORMAT, INFO_FILE, META_FILE, PIPELINE_FORMAT, read_info, resolve_checkpoint_dir
from .format import atomic_checkpoint_dir, engine_checkpoint_state, load_checkpoint_dir
from .prepared import _map_tensors, prepare_checkpoint, release_saved_state, write_prepared
from .local_copies import local_checkpoint_copy
from .trust import confined

PIPELINE_VERSION = 2
STAGE_DIR = "stage{}"
_PathLike = Union[str, Path]


def save_pipeline_checkpoint(pipe: Any, path: _PathLike, metadata: Optional[dict] = None, saver=None) -> Path:
    """Write ``path`` for ``pipe`` (a training PipelineZero): every chunk's stage directory over its
    data-parallel group, then the manifest and ``metadata``. Collective over the world. ``saver``: an
    AsyncCheckpointer writing it in the background (async_save.py; its groups stand in for the pipeline's)."""
    if not pipe.trains:
        raise RuntimeError("an evaluation-only pipeline (optimizer=None) has no training state to checkpoint. "
                           "Allowed: save from the training PipelineZero.")
    parts, finish = _prepare(pipe, metadata)
    if saver is not None:
        saver.save(path, parts, engines=pipe.engines, finish=finish, groups=[pipe.layout.pp_group])
        return Path(path)
    try:
        with atomic_checkpoint_dir(path) as tmp:
            for sub, prepared, group in parts:
                write_prepared(tmp / sub, prepared, group)
            finish(tmp, lambda g: g)
    finally:
        for engine in pipe.engines:
            release_saved_state(engine)
    return Path(path)


def _prepare(pipe: Any, metadata: Optional[dict]):
    """Each chunk's prepared stage directory over its data-parallel group ([Note: a save in two halves],
    prepared.py), and ``finish(tmp, group_of)``: the manifest, after a gather over the pipeline."""
    lay, mine, parts = pipe.layout, {}, []
    for module, engine, index in zip(pipe.modules, pipe.engines, pipe.stage_indices):
        model, optim, meta = engine_checkpoint_state(module, engine, group=lay.dp_group)
        parts.append((STAGE_DIR.format(index),
                      prepare_checkpoint(model, module, engine, optim, meta, process_group=lay.dp_group), lay.dp_group))
        mine[index] = {"dir": STAGE_DIR.format(index), "params": sum(p.numel() for p in module.parameters()),
                       "source_names": source_names(module, index, module.state_dict())}
    meta = _map_tensors(dict(metadata or {}), lambda t: t.detach().cpu().clone())  # may be written later
    zero_stage = pipe.engine.config.stage

    def finish(tmp: Path, group_of) -> None:
        # each stage's json described by the rank that wrote it: at a URL every rank writes into its own
        # staging directory ([Note: checkpoints at fsspec locations]), so rank 0 cannot read the others'
        written = [f"{e['dir']}/{INFO_FILE}" for e in mine.values() if (tmp / e["dir"] / INFO_FILE).is_file()]
        stages, described = _gather_over_pipeline((mine, integrity.describe_files(tmp, written)),
                                                  None if lay.pp_group is None else group_of(lay.pp_group))
        if _rank() != 0:
            return
        manifest = {"format": PIPELINE_FORMAT, "version": PIPELINE_VERSION,
                    "num_stages": len(stages), "pipeline_parallel_size": lay.num_stages,
                    "chunks": len(pipe.modules), "data_parallel_size": lay.dp_size,
                    "zero_stage": zero_stage, "stages": {str(i): stages[i] for i in sorted(stages)}}
        torch.save(meta, tmp / META_FILE)
        # the stages' json files are written (the gather above follows them); each lists its own files
        files = {**integrity.describe_files(tmp, [META_FILE]), **described}
        manifest[integrity.FILES_KEY] = dict(sorted(files.items()))
        (tmp / INFO_FILE).write_text(json.dumps(integrity.seal(manifest), indent=1))

    return parts, finish


def _gather_over_pipeline(mine: tuple[dict, dict], pp_group: Any) -> tuple[dict, dict]:
    """Every stage's manifest entry (small: names and counts) and the description of every stage's json, on
    each rank, from the ranks of one pipeline."""
    if pp_group is None:
        return dict(mine[0]), dict(mine[1])
    every: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(every, mine, group=pp_group)
    return ({i: entry for part, _ in every for i, entry in part.items()},
            {n: d for _, files in every for n, d in files.items()})


def load_pipeline_checkpoint(pipe: Any, path: _PathLike, trust_checkpoint: bool = False) -> dict:
    """This rank's chunks from ``path`` (saved at any data-parallel size and ZeRO stage 0-2); an
    evaluation-only pipeline takes the weights only. Returns the manifest."""
    with local_checkpoint_copy(path, collective=True) as path:  # a URL: one download per host
        path = resolve_checkpoint_dir(path)
        manifest = read_manifest(path)
        shape = (manifest["pipeline_parallel_size"], manifest["chunks"])
        if shape != (pipe.layout.num_stages, len(pipe.modules)):
            raise ValueError(f"checkpoint {str(path)!r} was saved with pipeline_parallel_size={shape[0]} and {shape[1]} "
                             f"chunk(s) per rank; this run has {pipe.layout.num_stages} and {len(pipe.modules)}. Allowed: "
                             f"resume with the same pipeline shape (the data-parallel size and ZeRO stage may change), "
                             f"or consolidate it (`lightning-zero consolidate`) and load the uncut model's state dict.")
        for module, engine, index in zip(pipe.modules, pipe.engines, pipe.stage_indices):
            train = engine.mode is EngineMode.TRAIN
            load_checkpoint_dir(stage_dir(path, manifest, index), module, engine, load_optimizer=train,
                                process_group=pipe.layout.dp_group, trust_checkpoint=trust_checkpoint)
        pipe.restart_accumulation()
        return manifest


def is_pipeline_checkpoint(path: _PathLike) -> bool:
    """A directory whose ``zero_checkpoint.json`` names the pipeline format (any version)."""
    try:
        return json.loads((Path(path) / INFO_FILE).read_text()).get("format") == PIPELINE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


_MANIFEST_KEYS = {"num_stages": int, "pipeline_parallel_size": int, "chunks": int, "stages": dict}


def read_manifest(path: _PathLike) -> dict:
    """The manifest of a pipeline checkpoint (checked: its keys, its seal and files, every stage directory
    inside the checkpoint), with one clear error for anything else."""
    path = Path(path)
    if not is_pipeline_checkpoint(path):
        plain = _format_of(path) == FORMAT
        raise ValueError(f"{str(path)!r} is not a pipeline checkpoint directory" + (
            " but a ZeroStrategy checkpoint without pipeline parallelism. Allowed: resume it with ZeroStrategy "
            "without pipeline_parallel_size (any world size and stage), or consolidate it (`lightning-zero "
            "consolidate`) and load the uncut model's state dict." if plain else
            f" (no {INFO_FILE} with format {PIPELINE_FORMAT!r}). Allowed: a directory written by PipelineZero.save "
            "or by trainer.save_checkpoint with pipeline_parallel_size."))
    manifest = json.loads((path / INFO_FILE).read_text())
    if manifest.get("version") != PIPELINE_VERSION:
        raise ValueError(f"{str(path)!r} is a pipeline checkpoint of format version {manifest.get('version')!r} "
                         f"(version 1: full per-stage .pt files from a development build); this release reads "
                         f"version {PIPELINE_VERSION} (sharded DCP directories per stage). Allowed: a checkpoint "
                         f"saved by this release.")
    where = f"Corrupt pipeline checkpoint {str(path)!r}"
    integrity.verify(path, manifest, INFO_FILE)
    bad = [f"{k!r} {'is missing' if k not in manifest else 'has the wrong type'}" for k, t in _MANIFEST_KEYS.items()
           if not isinstance(manifest.get(k), t) or isinstance(manifest.get(k), bool)]
    if bad:
        raise ValueError(f"{where}: its {INFO_FILE} is malformed: {'; '.join(bad)}. Required: "
                         + ", ".join(f"{k} ({t.__name__})" for k, t in _MANIFEST_KEYS.items()) + ".")
    stages = manifest["stages"]
    missing = [str(i) for i in range(manifest["num_stages"]) if not isinstance(stages.get(str(i)), dict)]
    if missing or not (path / META_FILE).is_file():
        raise ValueError(f"{where}: " + (
            f"the manifest lists no directory for stage(s) {missing}." if missing else f"{META_FILE} is missing."))
    for i in range(manifest["num_stages"]):
        entry = stages[str(i)]
        if not isinstance(entry.get("source_names"), dict):
            raise ValueError(f"{where}: the manifest entry of stage {i} has no 'source_names' mapping.")
        stage_dir(path, manifest, i)
    integrity.check_listed(path, manifest, [META_FILE] + [f"{stages[str(i)]['dir']}/{INFO_FILE}"
                                                          for i in range(manifest["num_stages"])],
                           INFO_FILE, "the loader")
    return manifest


def stage_dir(path: Path, manifest: dict, index: int) -> Path:
    """Stage ``index``'s directory, confined to the checkpoint (a manifest may name only its own stages)."""
    return confined(path, manifest["stages"][str(index)].get("dir"), f"stage {index}'s directory")


def _format_of(path: Path) -> Any:
    try:
        return json.loads((path / INFO_FILE).read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        return None


def consolidate_pipeline_checkpoint(path: _PathLike, dtype: Optional[torch.dtype] = None,
                                    trust_checkpoint: bool = False) -> dict:
    """One state dict of the whole model under the uncut model's names, read from every stage's directory
    in this process (no process group); floating tensors cast to ``dtype`` when given."""
    path = resolve_checkpoint_dir(path)
    manifest = read_manifest(path)
    out: dict = {}
    for i in range(manifest["num_stages"]):
        entry, where = manifest["stages"][str(i)], stage_dir(path, manifest, i)
        stage = full_model_state(where, read_info(where, trust_checkpoint), dtype, trust_checkpoint=trust_checkpoint)
        unnamed = sorted(n for n in stage if n not in entry["source_names"])
        if unnamed:
            raise ValueError(f"Corrupt pipeline checkpoint {str(path)!r}: the manifest gives no uncut-model name for "
                             f"stage {i}'s tensors {unnamed[:10]}.")
        for name, value in stage.items():
            out[entry["source_names"][name]] = value
    return out


def write_consolidated(path: _PathLike, out: _PathLike, dtype: torch.dtype = torch.float32,
                       trust_checkpoint: bool = False) -> dict:
    """:func:`consolidate_pipeline_checkpoint` written to ``out`` (``.safetensors``: safetensors, else
    ``torch.save``), atomically. Returns {"tensors": n, "bytes": weights}."""
    sd = consolidate_pipeline_checkpoint(path, dtype, trust_checkpoint)
    out = Path(out)
    with atomic_output(out) as tmp:
        if out.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp))
        else:
            torch.save(sd, tmp)
    return {"tensors": len(sd), "bytes": sum(t.numel() * t.element_size() for t in sd.values())}
