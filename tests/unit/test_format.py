"""The code is laid out by a formatter and linted: `ruff format --check` and `ruff check` pass on the whole
repository (configuration in pyproject.toml: 100 columns; the notebooks' cells are left as written)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def ruff() -> list[str]:
    """The ruff beside this interpreter (the venv's), else the one on PATH."""
    here = Path(sys.executable).with_name("ruff")
    found = str(here) if here.exists() else shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: pip install -r requirements.txt")
    return [found]


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "check"])
def test_ruff_passes(command):
    done = subprocess.run(
        [*ruff(), *command, "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_ruff_finds_a_badly_formatted_file(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("x = [1,\n  2]\nimport os\n")
    for command in (["format", "--check"], ["check", "--select", "I,F"]):
        done = subprocess.run([*ruff(), *command, str(bad)], capture_output=True, text=True)
        assert done.returncode == 1, (command, done.stdout)
