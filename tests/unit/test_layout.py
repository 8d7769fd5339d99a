"""The layout of common/: the map in common/__init__.py lists exactly the tree, and the layers hold.

- every module under common/ is named in the map, and the map names no module that is not there;
- the harness imports no topic, no plot, no exhibit and no run tool; the instruments import no harness;
- a lesson imports no run tool: importing lesson 01 loads no `common.run` module;
- no top-level function or class name (private ones included) is defined in two modules of common/.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
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
        f"in the map, not the tree: {sorted(mapped() - modules())}"
    )


def test_the_harness_imports_no_topic_plot_or_run_tool():
    for path in sorted((COMMON / "harness").glob("*.py")):
        wrong = {n for n in imports(path) if not n.startswith(LOWER)}
        assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)}"


def runtime_imports(path: Path) -> set[str]:
    """`imports`, less what an `if TYPE_CHECKING:` block imports for annotations only."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
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
        wrong = {
            n
            for n in runtime_imports(path)
            if not n.startswith(("common.measure", "common.models"))
        }
        assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)}"


def test_the_check_sees_an_import_from_above(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from common.run.launch import run_lesson\nimport common.harness.env\n")
    assert imports(bad) == {"common.run.launch", "common.harness.env"}


def test_a_lesson_loads_no_run_tool():
    code = (
        "import importlib, sys; importlib.import_module('lessons.01_single_gpu'); "
        "print(sorted(m for m in sys.modules if m.startswith('common.run')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def defined_twice(paths) -> dict[str, list[str]]:
    """{name: [files]} for each top-level function or class name that more than one of `paths` defines."""
    where = defaultdict(list)
    for path in paths:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                where[node.name].append(path.as_posix())
    return {name: files for name, files in where.items() if len(set(files)) > 1}


def test_no_top_level_name_is_defined_in_two_modules():
    twice = defined_twice(sorted(COMMON.rglob("*.py")))
    assert not twice, (
        f"defined in more than one module of common/ (keep one, or rename one): {twice}"
    )


def test_the_check_sees_a_name_defined_twice(tmp_path):
    (tmp_path / "a.py").write_text("def spread(x):\n    return x\n\nclass Kept:\n    pass\n")
    (tmp_path / "b.py").write_text(
        "def _local(t):\n    return t\n\nasync def spread(y):\n    return y\n"
    )
    (tmp_path / "c.py").write_text("class _local:\n    def spread(self):\n        pass\n")
    found = defined_twice(sorted(tmp_path.glob("*.py")))
    assert sorted(found) == ["_local", "spread"]
    assert [Path(f).name for f in found["spread"]] == ["a.py", "b.py"]
