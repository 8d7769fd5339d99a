"""The layout of common/: the map in common/__init__.py lists exactly the tree, and the layers hold.

- every module under common/ is named in the map, and the map names no module that is not there;
- the harness imports no topic, no plot, no exhibit and no run tool; the instruments import no harness;
- a lesson imports no run tool: importing lesson 01 loads no `common.run` module.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import common

COMMON = Path(common.__file__).resolve().parent
ROOT = COMMON.parent
LOWER = ("common.harness", "common.measure")  # what the harness may import


def modules() -> set[str]:
    """Every module under common/, dotted below `common` (package __init__ files left out)."""
    found = set()
    for path in COMMON.rglob("*.py"):
        parts = path.relative_to(COMMON).with_suffix("").parts
        if parts[-1] != "__init__":
            found.add(".".join(parts))
    return found


def mapped() -> set[str]:
    return set(re.findall(r"^    ([a-z_]+(?:\.[a-z_]+)?)\s{2,}\S", common.__doc__, flags=re.M))


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return {n for n in names if n.startswith("common.")}


def test_the_map_lists_exactly_the_tree():
    assert mapped() == modules(), (
        f"in the tree, not the map: {sorted(modules() - mapped())}; "
        f"in the map, not the tree: {sorted(mapped() - modules())}")


def test_the_harness_imports_no_topic_plot_or_run_tool():
    for path in sorted((COMMON / "harness").glob("*.py")):
        wrong = {n for n in imports(path) if not n.startswith(LOWER)}
        assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)}"


def runtime_imports(path: Path) -> set[str]:
    """`imports`, less what an `if TYPE_CHECKING:` block imports for annotations only."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return {n for n in names if n.startswith("common.")}


def test_the_instruments_import_only_instruments_and_models():
    for path in sorted((COMMON / "measure").glob("*.py")):
        wrong = {n for n in runtime_imports(path) if not n.startswith(("common.measure", "common.models"))}
        assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)}"


def test_the_check_sees_an_import_from_above(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from common.run.launch import run_lesson\nimport common.harness.env\n")
    assert imports(bad) == {"common.run.launch", "common.harness.env"}


def test_a_lesson_loads_no_run_tool():
    code = ("import importlib, sys; importlib.import_module('lessons.01_single_gpu'); "
            "print(sorted(m for m in sys.modules if m.startswith('common.run')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
