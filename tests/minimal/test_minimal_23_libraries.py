"""minimal/23_libraries.py held to lesson 23: the plain-torch lines that Fabric's setup, setup_dataloaders and
backward run end at the parameters of the lesson's Fabric run (the sum of every parameter, in float64)."""

from __future__ import annotations

import json

import pytest

from common.run.launch import run_lesson
from common.run.processes import REPO_ROOT
from tests._lessons import DEV


@pytest.mark.timeout(600)
def test_23_minimal_ends_at_lesson_23s_fabric_parameters():
    lesson = (
        run_lesson("23_libraries", 2, DEV, 360).check().results
    )  # the launch the lesson test makes
    args = [
        "--grad-accum-steps",
        "1",
        "--epochs",
        "1",
    ]  # the lesson's run: 1 epoch, no accumulation
    run = run_lesson(REPO_ROOT / "minimal" / "23_libraries.py", 2, args, 120, results=False).check()
    (line,) = [json.loads(x) for x in run.stdout.splitlines() if x.startswith('{"param_sum"')]
    assert abs(line["param_sum"] - lesson["fabric_param_sum"]) <= 1e-6, (line, lesson)
