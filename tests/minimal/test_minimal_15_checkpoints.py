"""minimal/15_checkpoints.py held to lesson 15: launched as a user launches it (torchrun, 4 ranks, CPU), the
FSDP2 and DDP checkpoints saved by 4 ranks load on 2 exactly (the script checks that itself and exits
non-zero otherwise), and the bytes each rank's shard file holds are the lesson's, chunk for chunk."""

from __future__ import annotations

import json

import pytest

from common.run.launch import run_lesson
from common.run.processes import REPO_ROOT
from tests._lessons import DEV


@pytest.mark.timeout(900)
def test_15_a_checkpoint_of_4_ranks_loads_on_2_with_the_lessons_shard_bytes():
    run = run_lesson(
        REPO_ROOT / "minimal" / "15_checkpoints.py",
        4,
        [],
        480,
        env={"CUDA_VISIBLE_DEVICES": ""},
        results=False,
    ).check()
    (got,) = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert (got["saved_by"], got["loaded_by"]) == (4, 2)
    assert got["files"] == [f"__{r}_0.distcp" for r in range(4)]  # one file per saving rank
    assert got["fsdp2_max_diff"] == 0.0 and got["ddp_max_diff"] == 0.0  # lesson 15's claims: 0.0
    # the same shapes as the lesson's model: each rank's file holds the same tensor bytes (Adam's 0-d
    # step counters, which DCP spreads over the ranks, left out)
    chunks = run_lesson("15_checkpoints", 4, DEV, 480).check().results["fsdp2_chunks"]
    want = [sum(c["bytes"] for c in chunks if c["rank"] == r and c["sizes"]) for r in range(4)]
    assert got["shard_bytes_per_rank"] == want
