"""minimal/21_planning.py held to lesson 21: its formula bytes (DDP with its buckets and ZeRO 1-3, fp32 Adam) equal
the bytes the lesson predicts and MEASURES on the same model and world size, and the bytes of the tensors the script
builds in each layout (the script checks that, and 2 + 2 + 12 bytes per parameter in mixed precision, itself and
exits 1 otherwise: arithmetic; the lesson's measurement is what tests DDP and ZeRO)."""

from __future__ import annotations

import json

import pytest

from common.run.launch import run_lesson
from common.run.processes import REPO_ROOT

CPU = {"CUDA_VISIBLE_DEVICES": ""}
STAGES = {"0": "DDP", "1": "ZeRO-1", "2": "ZeRO-2", "3": "ZeRO-3"}


def minimal(nproc: int | None) -> dict:
    run = run_lesson(
        REPO_ROOT / "minimal" / "21_planning.py", nproc, [], 120, env=CPU, results=False
    ).check()
    (line,) = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return line


@pytest.mark.timeout(800)
def test_21_minimal_bytes_are_lesson_21s_on_2_ranks_and_1():
    lesson = run_lesson("21_planning", 2, [], 180).check().results  # the command notebook 21 runs
    for nproc in (2, None):
        got = minimal(nproc)
        assert got["world_size"] == (nproc or 1) and got["mixed_precision_bytes_per_param"] == 16.0
        assert got["formula"] == got["built"]
        assert got["formula"]["0"]["ddp_buckets"] == (
            4 * 6973 if nproc == 2 else 0
        )  # DDP's copy of the gradients
        if nproc == 2:  # the lesson's world: its predicted (and, by its claims, measured) bytes
            for stage, name in STAGES.items():
                for row, v in got["formula"][stage].items():
                    assert lesson["predicted_bytes"][name][row] == v, (name, row)
                    assert lesson["measured_bytes"][name][row] == v, (name, row)
