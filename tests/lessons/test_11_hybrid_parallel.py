"""Lesson 11: hybrid parallelism on 4 ranks (pp x dp, fsdp x tp) and 8 (pp x dp x tp): each equals one process
on the global batch; pp is the outermost grid dimension; every collective travels in the group of its dimension;
FSDP's all-gathers (the root is not resharded); the decision table in buffer and sent bytes; a diverged run fails
and exits 1; bad input."""

from __future__ import annotations

import pytest

from common.run.launch import run_lesson
from tests._lessons import assert_claims, assert_fails_on_every_rank, assert_lines_fit

LESSON = "11_hybrid_parallel"


@pytest.fixture(scope="module")
def four_run():
    return run_lesson(LESSON, nproc=4, timeout_s=480).check()


@pytest.fixture(scope="module")
def four(four_run):
    return four_run.results


def _groups(table):
    return {(r["op"], r["dim"], tuple(r["ranks"])) for r in table}


@pytest.mark.timeout(600)
def test_dp_x_pp_and_fsdp_x_tp_equal_one_process_on_the_global_batch(four):
    claims = assert_claims(
        four,
        {
            "dp_pp_equals_one_process",
            "fsdp_tp_equals_one_process",
            "dp_pp_collectives_in_their_groups",
            "fsdp_tp_collectives_in_their_groups",
            "fsdp_tp_forward_all_gathers",
            "fsdp_tp_backward_all_gathers",
        },
    )
    assert claims["dp_pp_equals_one_process"]["value"] <= 1e-5
    assert claims["fsdp_tp_equals_one_process"]["value"] <= 1e-5
    # 4 blocks + the root: 5 all-gathers forward, 4 backward (the root stays unsharded after forward)
    assert claims["fsdp_tp_forward_all_gathers"]["value"] == 5
    assert claims["fsdp_tp_backward_all_gathers"]["value"] == 4


@pytest.mark.timeout(600)
def test_the_last_line_counts_the_checks_that_hold(four_run):
    assert four_run.stdout.splitlines()[-1] == f"{len(four_run.results['claims'])} checks hold"
    assert_lines_fit(four_run)


@pytest.mark.timeout(600)
def test_which_collective_travelled_in_which_group(four):
    # pp x dp = 2 x 2, pp outermost: ranks [[0, 1], [2, 3]]: dp groups are rows, pp groups columns, so on two
    # nodes of two ranks each pipeline crosses the nodes and each dp group stays inside one
    assert _groups(four["dp_pp_groups"]) == {
        ("all_reduce", "dp", (0, 1)),
        ("all_reduce", "dp", (2, 3)),
        ("send", "pp", (0, 2)),
        ("recv", "pp", (0, 2)),
        ("send", "pp", (1, 3)),
        ("recv", "pp", (1, 3)),
    }
    assert _groups(four["fsdp_tp_groups"]) == {
        ("all_gather", "dp", (0, 2)),
        ("all_gather", "dp", (1, 3)),
        ("reduce_scatter", "dp", (0, 2)),
        ("reduce_scatter", "dp", (1, 3)),
        ("all_reduce", "tp", (0, 1)),
        ("all_reduce", "tp", (2, 3)),
    }
    sends = [r for r in four["dp_pp_groups"] if r["op"] == "send"]
    assert all(
        r["calls"] == 2 and r["bytes"] == 2 * 4 * 8 * 32 * 4 for r in sends
    )  # 2 micro-batches (4, 8, 32)
    tp = [r for r in four["fsdp_tp_groups"] if r["op"] == "all_reduce"]
    assert all(r["calls"] == 2 * 4 for r in tp)  # one forward + one backward per block, 4 blocks


@pytest.mark.timeout(600)
def test_decision_table_has_a_row_per_parallelism_from_the_counts(four):
    table = {(r["parallelism"], r["op"]): r["bytes"] for r in four["decision_table"]}
    assert set(table) == {
        ("dp", "all_reduce"),
        ("fsdp", "all_gather"),
        ("fsdp", "reduce_scatter"),
        ("tp", "all_reduce"),
        ("pp", "send"),
    }
    counted = {
        (r["op"], r["dim"]): r["bytes"] for t in ("dp_pp_groups", "fsdp_tp_groups") for r in four[t]
    }
    assert table[("pp", "send")] == counted[("send", "pp")]
    assert table[("tp", "all_reduce")] == counted[("all_reduce", "tp")]
    assert (
        table[("pp", "send")] < table[("dp", "all_reduce")]
    )  # stage boundaries move less than gradients here
    sent = {(r["parallelism"], r["op"]): r["sent"] for r in four["decision_table"]}
    # at dp = 2 FSDP's all-gathers hand over twice DDP's buffer (forward and backward) but send about the same
    # bytes per rank on a ring: (n-1)/n of the full buffer, against 2 (n-1)/n for the all-reduce
    assert 1.8 <= table[("fsdp", "all_gather")] / table[("dp", "all_reduce")] <= 2.2
    assert 0.9 <= sent[("fsdp", "all_gather")] / sent[("dp", "all_reduce")] <= 1.1
    assert sent[("dp", "all_reduce")] == table[("dp", "all_reduce")]  # 2 (n-1)/n = 1 at n = 2
    assert sent[("fsdp", "reduce_scatter")] * 2 == table[("fsdp", "reduce_scatter")]


@pytest.mark.timeout(600)
def test_dp_x_pp_x_tp_on_8_ranks():
    """A tiny 2 x 2 x 2 configuration (about 25 s here on 2 shared cores)."""
    r = (
        run_lesson(LESSON, nproc=8, args=["--dp-pp", "none", "--fsdp-tp", "none"], timeout_s=480)
        .check()
        .results
    )
    claims = assert_claims(
        r, {"dp_pp_tp_equals_one_process", "dp_pp_tp_collectives_in_their_groups"}
    )
    assert claims["dp_pp_tp_equals_one_process"]["value"] <= 1e-5
    dims = {(row["op"], row["dim"]) for row in r["dp_pp_tp_groups"]}
    assert dims == {("all_reduce", "dp"), ("all_reduce", "tp"), ("send", "pp"), ("recv", "pp")}
    # pp outermost, tp innermost: with 4 ranks per node, tp pairs and dp pairs stay on a node, pipelines cross
    groups = {(row["dim"], tuple(row["ranks"])) for row in r["dp_pp_tp_groups"]}
    assert {g for d, g in groups if d == "pp"} == {(0, 4), (1, 5), (2, 6), (3, 7)}
    assert {g for d, g in groups if d == "tp"} == {(0, 1), (2, 3), (4, 5), (6, 7)}
    assert {g for d, g in groups if d == "dp"} == {(0, 2), (1, 3), (4, 6), (5, 7)}


@pytest.mark.timeout(300)
def test_a_diverged_run_fails_its_equality_claims_and_exits_1():
    """--lr 1e30 makes the parameters NaN: both equality claims must fail (a NaN difference once printed 0.0
    here), the last line names them, and the launch exits non-zero."""
    run = run_lesson(LESSON, nproc=2, args=["--lr", "1e30"], timeout_s=240)
    assert run.returncode != 0, run.stdout
    claims = run.results["claims"]
    assert {name for name, c in claims.items() if not c["holds"]} == {
        "dp_pp_equals_one_process",
        "fsdp_tp_equals_one_process",
    }
    assert run.stdout.splitlines()[-1] == (
        f"2 of {len(claims)} checks do not hold: dp_pp_equals_one_process, "
        "fsdp_tp_equals_one_process"
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--dp-pp", "3x2"], "the sizes must multiply to the world size"),
        (["--layers", "1"], "2 pipeline stages but only 1 layers"),
        (["--hidden", "33"], "does not divide the hidden size 33"),
    ],
)
def test_bad_input_fails_on_every_rank(args, message):
    run = run_lesson(LESSON, nproc=2, args=args, timeout_s=180)
    assert_fails_on_every_rank(run, 2, message)
