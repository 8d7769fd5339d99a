"""minimal/20_expert_parallel.py held to lesson 20's MoE layer (common.expert_parallel.moe): launched as users launch it, at
ep = 2 and as plain python, its rows sent per rank pair and its one-process loss are those of common.expert_parallel.moe.MoE
with top-1 routing and no drops at the same seed; the script checks EP = one process itself (exit 0)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from common.expert_parallel.moe import MoE
from common.run.launch import run_lesson
from common.run.processes import REPO_ROOT

CPU = {"CUDA_VISIBLE_DEVICES": ""}
H, E, N = 32, 4, 64  # the script's shapes


def reference(world_size: int, seed: int = 0) -> tuple[list, float]:
    """common.expert_parallel.moe at top-1, capacity factor E (C = N: nothing can be dropped): rows per rank pair, loss."""
    torch.manual_seed(seed)
    moe = MoE(
        H, E, k=1, capacity_factor=float(E)
    )  # router, then each expert's fc1 and fc2: the script's order
    x = torch.randn(world_size, N, H)
    rows, loss = [], 0.0
    with torch.no_grad():
        for r in range(world_size):
            loss += moe(x[r]).square().sum().item()
            assert moe.stats["dropped"] == 0
            rows.append(moe.stats["kept"].view(world_size, -1).sum(1).tolist())
    return rows, loss


@pytest.mark.timeout(480)
@pytest.mark.parametrize("nproc", [2, None])
def test_minimal_20_routes_like_the_lessons_moe_and_equals_one_process(nproc):
    run = run_lesson(
        REPO_ROOT / "minimal" / "20_expert_parallel.py", nproc, [], 180, env=CPU, results=False
    ).check()
    (got,) = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    rows, loss = reference(nproc or 1)
    assert got["ep"] == (nproc or 1)
    assert got["rows_sent"] == rows  # integers: exactly
    assert math.isclose(got["loss"], loss, rel_tol=1e-6)
    assert got["max_diff"] <= 1e-5
