"""The package's shape, read from its source: no import circle (function-level and TYPE_CHECKING imports
included), no file over 400 lines, and the tools, the checkpoint format and the Lightning adapter asking the
sharding plan and its placement instead of testing the stage or an offload knob ([Note: sharding plan],
[Note: placement])."""
import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_zero"
MAX_LINES = 400
PLACE = re.compile(r"offload|nvme", re.I)


def _files():
    return sorted(PACKAGE.rglob("*.py"))


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set) -> set:
    """The package modules ``path`` imports anywhere in its body (a name imported from a package that is
    itself a module counts as that module)."""
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            out.update(subs or [target])
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in modules and m != mod}


def _circles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    files = _files()
    modules = {_module(p) for p in files}
    graph = {_module(p): _imports(p, modules) for p in files}
    assert _circles(graph) == [], "modules importing each other (move the shared piece down into a module both import)"


def _subpackage(path: Path) -> str:
    rel = path.relative_to(PACKAGE).parts
    return rel[0] if len(rel) > 1 else "(top level)"


SUBPACKAGES = sorted({_subpackage(p) for p in _files()})


@pytest.mark.parametrize("subpackage", SUBPACKAGES)
def test_no_file_over_400_lines(subpackage):
    big = {str(p.relative_to(PACKAGE)): n for p in _files() if _subpackage(p) == subpackage
           for n in [p.read_text().count("\n")] if n > MAX_LINES}
    assert big == {}, f"split by concern: files over {MAX_LINES} lines"


def _branch_tests(tree):
    """Every test a branch makes: if / elif / while / conditional expression / assert / comprehension if."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            yield node.test
        elif isinstance(node, ast.comprehension):
            yield from node.ifs


def _names(expr) -> list:
    out = []
    for node in ast.walk(expr):
        if isinstance(node, ast.Name):
            out.append(node.id)
        elif isinstance(node, ast.Attribute):
            out.append(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(node.value)
    return out


def _branches(subpackage: str, asks) -> list:
    found = []
    for path in _files():
        if _subpackage(path) != subpackage:
            continue
        source = path.read_text()
        for test in _branch_tests(ast.parse(source)):
            if asks(path, _names(test)):
                line = source.splitlines()[test.lineno - 1].strip()
                found.append(f"{path.relative_to(PACKAGE)}:{test.lineno}: {line}")
    return found


def _is_store(path: Path) -> bool:
    """A module named for where bytes live (its branches on the target are its subject)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return any(re.search(r"store|offload|nvme|placement", part) for part in parts)


# Config and plan are where the knobs become the plan and its placement; they alone read them.
_DECIDERS = {"engine/config.py", "engine/plan.py"}
# Stage numbers as table keys: which ZeRO stages each parallel dim takes (the layout's one table).
_STAGE_TABLES = {"engine/layout/dims.py"}


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


@pytest.mark.parametrize("subpackage", SUBPACKAGES)
def test_placement_is_asked_not_tested(subpackage):
    """Where bytes live comes from ``plan.placement`` and the stores it names (book bytes per location, ask the
    store), not from ``offload == "nvme"`` tests; only modules named for a store (or a translation of DeepSpeed's
    offload keys) test it."""
    found = _branches(subpackage, lambda path, names: not _is_store(path) and _rel(path) not in _DECIDERS
                      and any(PLACE.search(n) for n in names))
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("subpackage", SUBPACKAGES)
def test_stage_rules_come_from_the_plan(subpackage):
    """What a stage shards comes from the plan's fields; stage numbers remain as labels, table keys, messages."""
    found = _branches(subpackage, lambda path, names: "stage" in names
                      and _rel(path) not in _DECIDERS | _STAGE_TABLES)
    assert found == [], "\n".join(found)


def test_every_engine_subpackage_says_what_lives_there_and_what_it_may_import():
    """engine/ is arranged by concern: each subpackage's docstring names its contents and its allowed imports
    (the import-linter contract in pyproject.toml layers them; tests/test_layers.py runs it)."""
    missing = []
    for init in sorted((PACKAGE / "engine").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if "May import" not in doc:
            missing.append(_rel(init))
    assert missing == [], missing
    contract = (PACKAGE.parent / "pyproject.toml").read_text()
    for sub in sorted(p.parent.name for p in (PACKAGE / "engine").glob("*/__init__.py")):
        if sub not in ("memory",):  # memory/ sits beside the layers: its floors read the plan, activations stage 3
            assert re.search(rf"lightning_zero\.engine\.{sub}\b", contract), f"engine/{sub} is not in the layers contract"
