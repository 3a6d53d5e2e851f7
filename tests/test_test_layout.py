"""The test suite's own layout: test modules share code through tests/helpers only, and pytest collects every file.

A test module importing another one's private helper breaks when that module is split, renamed or deleted, and
runs the other module's import-time code (fixtures, skips, sys.path edits) in its own; a test file that pytest
does not collect (a wrong name, an ignore in the config, an import error hidden by a skip) passes by not running.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _is_test_module(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf.startswith("test_") or leaf == "conftest"


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, at any depth (imports inside functions count), as a dotted name; a
    relative import is resolved against the file's package."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]  # from tests import test_x
    return found


def test_no_module_under_tests_imports_a_test_module():
    bad = []
    for path in _python_files():
        for line, name in _imported_modules(path):
            top = name.split(".")
            inside = top[0] == "tests" or (len(top) == 1 and (TESTS / f"{name}.py").exists())
            if inside and _is_test_module(name):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "move what they share into tests/helpers/ under a public name:\n" + "\n".join(bad)


def _exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_every_import_from_tests_names_a_module_that_exists():
    """An import inside a function (run only on a forked rank) of a moved helper fails only when it runs."""
    bad = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("tests"):
                names = [node.module]
                if node.module == "tests":  # from tests import helpers / from tests import x_models
                    names = [f"tests.{a.name}" for a in node.names]
            else:
                continue
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                    if n.split(".")[0] == "tests" and not _exists(n)]
    assert not bad, "imports of modules that do not exist:\n" + "\n".join(bad)


def test_tests_live_in_test_files_only():
    """A ``def test_`` outside a ``test_*.py`` file is never collected."""
    bad = []
    for path in _python_files():
        if path.name.startswith("test_"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        # what pytest would collect: module-level test_* functions and Test* classes (a LightningModule's
        # test_step is not one)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_") \
                    or isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not bad, "tests outside a test_*.py file (pytest skips them):\n" + "\n".join(bad)


@pytest.mark.timeout(600)
def test_every_test_file_is_collected():
    """pytest, run the way CI runs it (the pyproject configuration, from the repository root), collects at
    least one test from every tests/test_*.py and reports no collection error."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=570)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    collected = {line.split("::", 1)[0] for line in proc.stdout.splitlines() if "::" in line}
    files = {str(p.relative_to(ROOT)) for p in TESTS.glob("test_*.py")}
    missing = sorted(files - collected)
    assert not missing, f"pytest collects nothing from: {missing}"
    assert all(f.startswith("tests/") for f in collected)
