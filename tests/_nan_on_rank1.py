"""Run a lesson with a NaN in rank 1's replica whenever the lesson asks whether the replicas are identical.

    torchrun --standalone --nproc_per_node=2 tests/_nan_on_rank1.py lessons.03_ddp [the lesson's arguments]

The lesson's own `main` runs unchanged (through `run_main`, so the exit status is the lesson's). Only the name
`max_param_diff_across_ranks` is wrapped, in the lesson module and in every exhibit module that imported it:
on rank 1 the first element of the model's first parameter is NaN while the real helper compares, and is
put back afterwards, so the replica claim is the only one the plant can fail. A right check returns NaN on
every rank, the claim does not hold and the lesson exits 1; a check that drops rank 1's NaN (gloo's MAX)
returns 0.0 and the lesson exits 0.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

import common.harness.ranks
from common.exhibits.frame import load_exhibits
from common.harness.session import run_main

REAL = common.harness.ranks.max_param_diff_across_ranks
RUNNER = Path(__file__)


def launch_with_nan_on_rank1(lesson: str, args: Sequence[str] = (), timeout_s: float = 300):
    """`lesson` ("03_ddp") under torchrun with 2 processes, through this file; its `LessonRun`."""
    from common.run.launch import run_lesson

    return run_lesson(RUNNER, nproc=2, args=[f"lessons.{lesson}", *args], timeout_s=timeout_s)


def failing_claims(run) -> dict:
    """{name: value} of the claims in the run's results that do not hold."""
    assert run.results is not None, (
        "no results written:\n" + run.stdout[-3000:] + run.stderr[-3000:]
    )
    return {name: c["value"] for name, c in run.results["claims"].items() if not c["holds"]}


def nan_on_rank1(model: torch.nn.Module, info) -> float:
    p = next(model.parameters())
    first = (0,) * p.dim()
    with torch.no_grad():
        kept = p[first].item()
        if info.rank == 1:
            p[first] = float("nan")
        try:
            return REAL(model, info)
        finally:
            p[first] = kept


def main() -> None:
    name, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    lesson = importlib.import_module(name)
    load_exhibits()  # lesson 12's exhibit modules, imported now so that their name is wrapped too
    for module_name, module in list(sys.modules.items()):
        ours = (
            module_name.startswith(("lessons.", "common.")) and module is not common.harness.ranks
        )
        if ours and getattr(module, "max_param_diff_across_ranks", None) is REAL:
            module.max_param_diff_across_ranks = nan_on_rank1
    run_main(lesson.main)


if __name__ == "__main__":
    main()
