"""Re-execute the notebooks in place, so that their committed outputs come from a real run.

    python -m common.run.notebooks                      # every notebooks/*.ipynb
    python -m common.run.notebooks notebooks/03_ddp.ipynb

Each notebook runs top to bottom in a fresh kernel from its own folder (as nbval does), with a per-cell
timeout; the outputs are written back into the file. Then `python -m pytest notebooks` checks that a second run
reproduces them (nbval, strict mode).
"""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
MINIMAL = NOTEBOOKS.parent / "minimal"

# Which minimal script each one is a diff from: 01 -> 03 adds DDP, 04-08, 13 and 14 change 03's loop, the
# model-parallel scripts build on each other (10 -> 11), and a later lesson's script on the one it extends.
MINIMAL_BASE = {
    "02": "01",
    "03": "01",
    "04": "03",
    "05": "03",
    "06": "03",
    "07": "03",
    "08": "07",
    "09": "03",
    "10": "03",
    "11": "10",
    "13": "03",
    "16": "03",
    "19": "10",
    "20": "19",
    "21": "13",
}


def minimal_path(number: str) -> Path:
    """minimal/NN_*.py for lesson number "NN"."""
    found = sorted(MINIMAL.glob(f"{number}_*.py"))
    if not found:
        raise FileNotFoundError(f"no minimal/{number}_*.py")
    return found[0]


def minimal_diff(lesson: str, base: str | None = None, context: int = 1) -> str:
    """The unified diff from the previous minimal script in the chain to lesson `lesson`'s ("03" or
    "03_ddp"), read from the files now, so a notebook cell that prints it can never show stale code."""
    number = lesson[:2]
    old, new = minimal_path(base or MINIMAL_BASE[number]), minimal_path(number)
    lines = difflib.unified_diff(
        old.read_text().splitlines(),
        new.read_text().splitlines(),
        f"minimal/{old.name}",
        f"minimal/{new.name}",
        n=context,
        lineterm="",
    )
    return "\n".join(lines)


def execute_in_place(path: Path, timeout_s: int = 180) -> float:
    """Execute `path` in a fresh python3 kernel and overwrite it with its outputs; returns seconds taken."""
    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(
        nb,
        timeout=timeout_s,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    nbformat.write(nb, path)
    return time.perf_counter() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="re-execute notebooks in place")
    p.add_argument("paths", nargs="*", type=Path, help="default: every notebooks/*.ipynb")
    p.add_argument("--timeout-s", type=int, default=180, help="per cell")
    args = p.parse_args(argv)
    paths = args.paths or sorted(NOTEBOOKS.glob("*.ipynb"))
    for path in paths:
        print(f"{path}: {execute_in_place(path, args.timeout_s):.1f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
