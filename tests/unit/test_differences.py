"""NaN-safe differences (common/measure/differences.py and every helper built on it): a NaN or an inf at the first, a
middle or the last position makes the difference one that fails an equality claim (`holds(v, "<=", 1e-5)`)."""

from __future__ import annotations

import math

import pytest
import torch

from common.checkpoint.train_state import max_diff_over_ranks
from common.data_parallel.bn_stats import spread
from common.harness.env import DistInfo
from common.harness.results import holds
from common.measure.differences import max_abs_diff, max_abs_diff_all, max_over_ranks, nan_max
from common.run.processes import REPO_ROOT
from common.tensor_parallel.layers import digits_transformer, max_shard_diff, tensor_parallelize
from tests._10_workers import nan_on_one_rank
from tests._workers import param_diff, run_world

BAD = [float("nan"), float("inf"), float("-inf")]
WHERE = ["first", "middle", "last"]


def _fails(v) -> bool:
    return not holds(float(v), "<=", 1e-5)


def _tensors(bad: float, where: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three pairs of equal tensors; one element of the first, a middle or the last tensor of `a` made `bad`."""
    torch.manual_seed(0)
    b = [torch.randn(4, 3) for _ in range(3)]
    a = [t.clone() for t in b]
    i = {"first": 0, "middle": 1, "last": 2}[where]
    a[i][{"first": (0, 0), "middle": (2, 1), "last": (3, 2)}[where]] = bad
    return a, b


def test_python_max_and_equal_lists_are_what_we_guard_against():
    assert max(0.0, math.nan) == 0.0  # why nan_max exists: Python's max keeps the old value
    a, b = _tensors(0.0, "first")
    assert max_abs_diff_all(b, b) == 0.0 and nan_max([]) == 0.0


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("bad", BAD)
def test_every_difference_helper_fails_on_a_non_finite_element(bad, where):
    a, b = _tensors(bad, where)
    i = WHERE.index(where)
    values = [0.0, 0.0, 0.0]
    values[i] = bad
    assert _fails(nan_max(values))
    assert _fails(max_abs_diff(a[i], b[i])) and _fails(max_abs_diff(b[i], a[i]))
    assert _fails(max_abs_diff_all(a, b)) and _fails(max_abs_diff_all(b, a))
    assert _fails(max_abs_diff_all([t.bfloat16() for t in a], [t.bfloat16() for t in b]))
    assert _fails(max_over_ranks(values[i]))  # no process group: the value itself
    stats = torch.zeros(2, 6, dtype=torch.float64)  # 2 ranks, one BatchNorm layer of 3 channels
    stats[1, i] = bad  # a running mean
    stats[1, 3 + i] = bad  # a running variance
    assert all(_fails(v) for v in spread(stats, [3]))


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("bad", BAD)
def test_model_differences_fail_on_a_non_finite_parameter(bad, where):
    torch.manual_seed(0)
    model = digits_transformer(8, 2, 2)
    split = tensor_parallelize(model, 0, 1, None)
    params = list(split.parameters())
    p = params[{"first": 0, "middle": len(params) // 2, "last": -1}[where]]
    with torch.no_grad():
        p.view(-1)[{"first": 0, "middle": p.numel() // 2, "last": -1}[where]] = bad
    assert _fails(max_shard_diff(model, split, 0)) and _fails(max_shard_diff(split, model, 0))
    ref = [q.detach().clone() for q in model.parameters()]
    assert _fails(max_diff_over_ranks(split, ref, DistInfo()))
    split(torch.rand(2, 8, 8)).sum().backward()
    model(torch.rand(2, 8, 8)).sum().backward()
    assert _fails(
        max_shard_diff(model, split, 0, grads=True)
    )  # the non-finite weight poisons the gradients


@pytest.mark.timeout(60)
def test_a_nan_on_another_rank_survives_the_maximum_over_ranks(tmp_path):
    for rank, facts in enumerate(run_world(nan_on_one_rank, 2, tmp_path)):
        assert facts["nan"]["gloo_max"] == 0.0, (
            "gloo's MAX no longer drops a NaN: update common/measure/differences.py"
        )
        for name in ("nan", "inf"):
            f = facts[name]
            assert _fails(f["max_over_ranks"]) and _fails(f["max_diff_over_ranks"]), (rank, name, f)
        assert (
            math.isnan(facts["nan"]["max_over_ranks"])
            and facts["inf"]["max_over_ranks"] == math.inf
        )


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("bad", "world_size"), [(math.nan, 2), (math.nan, 3), (math.inf, 2), (-math.inf, 3)]
)
def test_replicas_check_fails_when_rank_1_alone_holds_a_non_finite_weight(
    tmp_path, bad, world_size
):
    """The check behind every "replicas identical" claim (lessons 02, 03, 05, 06, 07 and lesson 12's exhibits):
    rank 0 is finite, so a raw all-reduce with MAX would return its 0.0 on every rank."""
    out = run_world(param_diff, world_size, tmp_path, bad, 1)
    assert all(_fails(v) for v in out), out
    assert all(math.isnan(v) for v in out) if math.isnan(bad) else out == [math.inf] * world_size


# Where an all-reduce with a raw MAX is right: what it reduces cannot be NaN (a length, a flag, bytes, seconds)
RAW_MAX_ALLOWED = {
    "common/measure/differences.py": 1,  # max_over_ranks itself: a NaN travels as +inf and a flag
    "common/measure/bandwidth.py": 1,  # the slowest rank's seconds
    "common/exhibits/collectives.py": 2,  # a length to pad to, a skip flag
    "lessons/02_collectives.py": 1,  # bytes on the busiest link (a count)
}


def test_no_difference_is_maximised_over_ranks_with_a_raw_max():
    """A difference behind a claim crosses ranks through `max_over_ranks`: gloo's MAX drops a NaN that is not
    on rank 0 (the test above). New uses of ReduceOp.MAX must be for numbers that cannot be NaN."""
    found = {}
    for top in ("common", "lessons", "exercises"):
        for path in sorted((REPO_ROOT / top).rglob("*.py")):
            n = path.read_text().count("ReduceOp.MAX")
            if n:
                found[path.relative_to(REPO_ROOT).as_posix()] = n
    extra = {f: n for f, n in found.items() if n > RAW_MAX_ALLOWED.get(f, 0)}
    assert not extra, (
        f"all-reduces with a raw MAX (use common.measure.differences.max_over_ranks): {extra}"
    )
