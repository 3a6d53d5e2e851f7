"""The engine's structure (issue 29, item 2): the stage read once as a ShardingPlan, collaborators that get
what they need instead of writing into ZeroEngine or reading its privates, and no import circle through it."""

import ast
import pathlib

import pytest

import lightning_zero.engine as engine_pkg
from lightning_zero.engine.config import PRESETS, ZeroConfig
from lightning_zero.engine.plan import Publish, ShardingPlan

ENGINE_DIR = pathlib.Path(engine_pkg.__file__).parent
# the modules that compose whole engines (a pipeline holds one per stage chunk) may name the engine module
COMPOSERS = {"engine.py", "__init__.py", "pipeline/pipeline_zero.py"}


def _collaborators(composers=COMPOSERS):
    return sorted(p for p in ENGINE_DIR.rglob("*.py") if p.relative_to(ENGINE_DIR).as_posix() not in composers)


@pytest.mark.parametrize("stage, optimizer_state, grads, params, publish", [
    (0, False, False, False, Publish.COPY),
    (1, True, False, False, Publish.ALL_GATHER),
    (2, True, True, False, Publish.ALL_GATHER),
    (3, True, True, True, Publish.UNIT_SHARDS),
])
def test_plan_rows_follow_the_note(stage, optimizer_state, grads, params, publish):
    plan = ShardingPlan.of(ZeroConfig(stage=stage))
    assert (plan.shards_optimizer_state, plan.shards_grads, plan.shards_params, plan.publish) == (
        optimizer_state, grads, params, publish)
    assert not plan.overlap_publish and not plan.separate_masters


def test_plan_options_only_where_they_apply():
    assert ShardingPlan.of(ZeroConfig(stage=1, overlap_publish=True)).overlap_publish
    # qwZ rounds the gathered parameters of stages 1-2 only: stage 3 masters come from the unit shards
    assert ShardingPlan.of(ZeroConfig(stage=2, quantize_weights=True)).separate_masters
    assert not ShardingPlan.of(ZeroConfig(stage=3, quantize_weights=True)).separate_masters
    for name, knobs in PRESETS.items():
        assert ShardingPlan.of(ZeroConfig(**knobs)).stage == knobs["stage"], name


def _imports_engine_module(tree: ast.AST, path: pathlib.Path) -> list[str]:
    depth = len(path.relative_to(ENGINE_DIR).parts) - 1  # "." inside engine/, ".." inside engine/stage3/
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if (node.level == depth + 1 and target == "engine") or target == "lightning_zero.engine.engine":
                bad.append(f"from {'.' * node.level}{target} import ...")
    return bad


def test_no_collaborator_imports_the_engine_module():
    """param_groups / publish / full_state / stage3.setup get their inputs as arguments: no circle back."""
    found = {p.name: b for p in _collaborators() if (b := _imports_engine_module(ast.parse(p.read_text()), p))}
    assert not found, f"modules importing engine.py (the engine composes them, not the reverse): {found}"


def test_no_collaborator_writes_or_reads_engine_privates():
    """Nothing under engine/ but engine.py and its constructor (builder.py, which assembles it) assigns an
    attribute of an ``engine`` or reads one of its privates (the pipeline included: it reads the norms through
    ``shard_sq_norms`` / ``set_grad_sq_norm``)."""
    found = []
    for p in _collaborators({"engine.py", "builder.py"}):
        for node in ast.walk(ast.parse(p.read_text())):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "engine"):
                continue
            if isinstance(node.ctx, ast.Store) or node.attr.startswith("_"):
                found.append(f"{p.relative_to(ENGINE_DIR)}:{node.lineno} engine.{node.attr}")
    assert not found, found
