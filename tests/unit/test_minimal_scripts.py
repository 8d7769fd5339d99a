"""The promises every minimal/ script makes, checked on the files without running them (fast):
at most 120 lines including the docstring, lines of at most 110 characters (ruff format keeps the code at
100; prose in docstrings and comments at 110, as in the lessons), imports of torch, numpy and the
standard library only (no `common`, no `lessons`), and a process group from torchrun's environment that a
`finally` destroys."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

MINIMAL = Path(__file__).resolve().parents[2] / "minimal"
SCRIPTS = sorted(MINIMAL.glob("[0-9][0-9]_*.py"))
ALLOWED = {"torch", "numpy"} | set(sys.stdlib_module_names)


def test_minimal_scripts_exist():
    names = {p.stem for p in SCRIPTS}
    assert {
        "01_single_gpu",
        "02_collectives",
        "03_ddp",
        "04_custom_sampler",
        "05_uneven_data",
        "06_sync_batchnorm",
        "07_gradient_accumulation",
    } <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_short_lines_and_file(path):
    lines = path.read_text().splitlines()
    assert len(lines) <= 120, f"{path.name}: {len(lines)} lines"
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 110]
    assert not long, f"{path.name}: lines over 110 characters: {long}"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_imports_torch_numpy_and_stdlib_only(path):
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            imported.add(node.module.split(".")[0])
    assert "common" not in imported and "lessons" not in imported, path.name
    assert imported <= ALLOWED, f"{path.name} imports {sorted(imported - ALLOWED)}"


def _calls(nodes, name: str) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == name
        for node in nodes
        for n in ast.walk(node)
    )


@pytest.mark.parametrize(
    "path", [p for p in SCRIPTS if p.stem != "01_single_gpu"], ids=lambda p: p.stem
)
def test_process_group_from_torchrun_env_destroyed_in_finally(path):
    source = path.read_text()
    tree = ast.parse(source)
    assert _calls([tree], "init_process_group"), path.name
    finals = [n.finalbody for n in ast.walk(tree) if isinstance(n, ast.Try)]
    assert any(_calls(body, "destroy_process_group") for body in finals), path.name
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        assert f'"{var}"' in source, f"{path.name} does not read {var}"
