"""Lesson 11: hybrid parallelism on 4 ranks (dp x pp, fsdp x tp) and 8 (dp x pp x tp): each equals one process
on the global batch; every collective travels in the group of its dimension; the decision table; bad input."""
from __future__ import annotations

import pytest

from common.launch import run_lesson
from tests._lessons import assert_claims, assert_fails_on_every_rank

LESSON = "11_hybrid_parallel"


@pytest.fixture(scope="module")
def four():
    return run_lesson(LESSON, nproc=4, timeout_s=240).check().results


def _groups(table):
    return {(r["op"], r["dim"], tuple(r["ranks"])) for r in table}


@pytest.mark.timeout(300)
def test_dp_x_pp_and_fsdp_x_tp_equal_one_process_on_the_global_batch(four):
    claims = assert_claims(four, {"dp_pp_equals_one_process", "fsdp_tp_equals_one_process",
                                  "dp_pp_collectives_in_their_groups", "fsdp_tp_collectives_in_their_groups"})
    assert claims["dp_pp_equals_one_process"]["value"] <= 1e-5
    assert claims["fsdp_tp_equals_one_process"]["value"] <= 1e-5


@pytest.mark.timeout(300)
def test_which_collective_travelled_in_which_group(four):
    # dp x pp = 2 x 2: ranks [[0, 1], [2, 3]]: pp groups are rows, dp groups columns
    assert _groups(four["dp_pp_groups"]) == {
        ("all_reduce", "dp", (0, 2)), ("all_reduce", "dp", (1, 3)),
        ("send", "pp", (0, 1)), ("recv", "pp", (0, 1)), ("send", "pp", (2, 3)), ("recv", "pp", (2, 3))}
    assert _groups(four["fsdp_tp_groups"]) == {
        ("all_gather", "dp", (0, 2)), ("all_gather", "dp", (1, 3)), ("reduce_scatter", "dp", (0, 2)),
        ("reduce_scatter", "dp", (1, 3)), ("all_reduce", "tp", (0, 1)), ("all_reduce", "tp", (2, 3))}
    sends = [r for r in four["dp_pp_groups"] if r["op"] == "send"]
    assert all(r["calls"] == 2 and r["bytes"] == 2 * 4 * 8 * 32 * 4 for r in sends)  # 2 micro-batches (4, 8, 32)
    tp = [r for r in four["fsdp_tp_groups"] if r["op"] == "all_reduce"]
    assert all(r["calls"] == 2 * 4 for r in tp)  # one forward + one backward per block, 4 blocks


@pytest.mark.timeout(300)
def test_decision_table_has_a_row_per_parallelism_from_the_counts(four):
    table = {(r["parallelism"], r["op"]): r["bytes"] for r in four["decision_table"]}
    assert set(table) == {("dp", "all_reduce"), ("fsdp", "all_gather"), ("fsdp", "reduce_scatter"),
                          ("tp", "all_reduce"), ("pp", "send")}
    counted = {(r["op"], r["dim"]): r["bytes"] for t in ("dp_pp_groups", "fsdp_tp_groups") for r in four[t]}
    assert table[("pp", "send")] == counted[("send", "pp")]
    assert table[("tp", "all_reduce")] == counted[("all_reduce", "tp")]
    assert table[("pp", "send")] < table[("dp", "all_reduce")]  # stage boundaries move less than gradients here


@pytest.mark.timeout(300)
def test_dp_x_pp_x_tp_on_8_ranks():
    """A tiny 2 x 2 x 2 configuration (about 25 s here on 2 shared cores)."""
    r = run_lesson(LESSON, nproc=8, args=["--dp-pp", "none", "--fsdp-tp", "none"], timeout_s=240).check().results
    claims = assert_claims(r, {"dp_pp_tp_equals_one_process", "dp_pp_tp_collectives_in_their_groups"})
    assert claims["dp_pp_tp_equals_one_process"]["value"] <= 1e-5
    dims = {(row["op"], row["dim"]) for row in r["dp_pp_tp_groups"]}
    assert dims == {("all_reduce", "dp"), ("all_reduce", "tp"), ("send", "pp"), ("recv", "pp")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, message", [
    (["--dp-pp", "3x2"], "the sizes must multiply to the world size"),
    (["--layers", "1"], "2 pipeline stages but only 1 layers"),
    (["--hidden", "33"], "does not divide the hidden size 33")])
def test_bad_input_fails_on_every_rank(args, message):
    run = run_lesson(LESSON, nproc=2, args=args, timeout_s=90)
    assert_fails_on_every_rank(run, 2, message)
