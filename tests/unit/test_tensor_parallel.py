"""Hand-built tensor parallelism (common/tensor_parallel/layers.py) and the DTensor counter (common/measure/dtensor_counts.py):
split = unsplit, one all-reduce forward and one backward per block, 1/tp of the weights, one clear error."""

from __future__ import annotations

import pytest
import torch

from common.harness.env import LessonError
from common.tensor_parallel.layers import (
    MLP,
    TPMLP,
    ColumnParallelLinear,
    RowParallelLinear,
    check_tp_degree,
    digits_transformer,
    max_shard_diff,
    tensor_parallelize,
)
from tests._10_workers import dtensor_mlp_counts, hand_built_blocks
from tests._workers import run_world

TOL = 1e-5
ACT_BYTES = 3 * 5 * 16 * 4  # batch x sequence x hidden x 4 bytes (float32)


def test_world_of_one_is_the_unsplit_module_and_shards_are_chunks():
    torch.manual_seed(0)
    full = MLP(8)
    split = TPMLP(full, 0, 1, None)  # tp = 1, no group: f and g are identities
    x = torch.randn(2, 3, 8)
    assert torch.equal(split(x), full(x))
    col, row = ColumnParallelLinear(full.fc1, 1, 4), RowParallelLinear(full.fc2, 1, 4, None)
    assert torch.equal(col.weight, full.fc1.weight[8:16]) and torch.equal(
        col.bias, full.fc1.bias[8:16]
    )
    assert torch.equal(row.weight, full.fc2.weight[:, 8:16]) and torch.equal(
        row.bias, full.fc2.bias
    )
    model = digits_transformer(8, 2, 1)
    split = tensor_parallelize(model, 0, 1, None)
    assert max_shard_diff(model, split, 0) == 0.0
    with torch.no_grad():
        split[1].mlp.fc1.weight[0, 0] += 1.0
    assert max_shard_diff(model, split, 0) == pytest.approx(1.0)  # the comparison sees a change


@pytest.mark.parametrize("tp, hidden, heads", [(3, 16, 0), (4, 18, 0), (4, 16, 2), (2, 16, 3)])
def test_a_degree_that_does_not_divide_is_one_clear_error(tp, hidden, heads):
    with pytest.raises(LessonError, match="does not divide|must divide"):
        check_tp_degree(tp, hidden, heads)


@pytest.mark.timeout(180)
def test_hand_built_split_equals_unsplit_at_tp2(tmp_path):
    for rank, facts in enumerate(run_world(hand_built_blocks, 2, tmp_path)):
        for name in ("mlp", "attention"):
            f = facts[name]
            assert f["out"] <= TOL and f["in_grad"] <= TOL and f["w_grad"] <= TOL, (rank, name, f)
            # one all-reduce forward (g) and one backward (f), each of the whole activation, in the tp group
            assert f["fwd"] == (
                {"all_reduce": 1},
                {"all_reduce": ACT_BYTES},
                {("all_reduce", (0, 1)): 1},
            )
            assert f["bwd"] == (
                {"all_reduce": 1},
                {"all_reduce": ACT_BYTES},
                {("all_reduce", (0, 1)): 1},
            )
            assert f["weight_numel"] * 2 == f["full_weight_numel"]
        assert facts["model"]["w_grad"] <= TOL and facts["model"]["names"]


@pytest.mark.timeout(180)
def test_dtensor_counter_sees_parallelize_modules_all_reduces(tmp_path):
    for facts in run_world(dtensor_mlp_counts, 2, tmp_path):
        assert facts["out"] <= TOL
        assert facts["fwd"] == (
            {"all_reduce": 1},
            {"all_reduce": ACT_BYTES},
            {("all_reduce", (0, 1)): 1},
        )
        assert facts["bwd"] == (
            {"all_reduce": 1},
            {"all_reduce": ACT_BYTES},
            {("all_reduce", (0, 1)): 1},
        )
