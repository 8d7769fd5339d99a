"""Re-execute the notebooks in place, so that their committed outputs come from a real run.

    python -m common.run.notebooks                      # every notebooks/*.ipynb
    python -m common.run.notebooks notebooks/03_ddp.ipynb

Each notebook runs top to bottom in a fresh kernel from its own folder (as nbval does), with a per-cell
timeout; the outputs are written back into the file. Then `python -m pytest notebooks` checks that a second run
reproduces them (nbval, strict mode).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


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
