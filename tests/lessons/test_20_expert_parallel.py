"""Lesson 20: expert parallelism at ep = 1 (one process), 2 and 4 (then dp 2 x ep 2): the MoE layer and
training equal one process, the rows sent equal the routing histogram, all-to-all calls and bytes, drops
counted, the gradient reductions per group, the balance loss; bad input fails on every rank."""

from __future__ import annotations

import pytest

from common.run.launch import run_lesson
from tests._20_workers import unreached_expert_after_momentum
from tests._lessons import assert_claims, assert_fails_on_every_rank, assert_lines_fit
from tests._workers import run_world

LESSON = "20_expert_parallel"
H, N = 32, 63  # the lesson's --hidden and --tokens
ROUTING = {
    "kept_equals_min_count_capacity",
    "dropped_counted_exactly",
    "dropped_choices_add_nothing",
}
LAYER = {
    "layer_equals_one_process",
    "rows_sent_equal_histogram",
    "all_to_alls_forward_backward",
    "bytes_equal_formula",
}
EP = {
    f"ep_{c}"
    for c in (
        "training_equals_one_process",
        "params_equal_one_process",
        "test_loss_falls",
        "gradient_reductions",
    )
}
EP_DP = {
    f"ep_dp_{c}"
    for c in ("training_equals_one_process", "params_equal_one_process", "gradient_reductions")
}  # 10 steps: the loss ratio is a value
BALANCE = {"balance_loss_evens_the_histogram"}
TORCH = {"torch_all_to_all_agrees"}  # needs a process group


@pytest.fixture(scope="module")
def one_process_run():
    return run_lesson(LESSON, nproc=None, timeout_s=240).check()


@pytest.fixture(scope="module")
def ep2_run():
    return run_lesson(LESSON, nproc=2, timeout_s=360).check()


@pytest.fixture(scope="module")
def ep4_run():
    return run_lesson(LESSON, nproc=4, timeout_s=600).check()


@pytest.fixture(scope="module")
def one_process(one_process_run):
    return one_process_run.results


@pytest.fixture(scope="module")
def ep2(ep2_run):
    return ep2_run.results


@pytest.fixture(scope="module")
def ep4(ep4_run):
    return ep4_run.results


@pytest.mark.timeout(300)
def test_one_process_is_the_reference_itself(one_process):
    claims = assert_claims(one_process, ROUTING | LAYER | EP | BALANCE)
    assert not (EP_DP | TORCH) & set(claims)
    assert claims["layer_equals_one_process"]["value"] == 0.0
    assert claims["bytes_equal_formula"]["value"] == 0  # nothing leaves a world of one
    assert 0 < one_process["rows_sent"][0][0] <= N * 2  # kept assignments of N tokens, top-2


@pytest.mark.timeout(400)
def test_ep2_layer_and_training_equal_one_process_and_rows_follow_the_histogram(ep2):
    claims = assert_claims(ep2, ROUTING | LAYER | EP | BALANCE | TORCH)
    sent = ep2["rows_sent"]
    assert len(sent) == 2 and all(len(row) == 2 for row in sent)
    off_diagonal = sent[0][1] + sent[1][0]
    assert off_diagonal > 0
    assert claims["bytes_equal_formula"]["value"] == 4 * off_diagonal * H * 4
    assert claims["ep_training_equals_one_process"]["value"] <= 1e-5
    for r, tokens in enumerate(
        ep2["destinations"]
    ):  # per token and choice: the rank it went to, -1 dropped
        assert [sum(d == dest for t in tokens for d in t) for dest in range(2)] == sent[r]


@pytest.mark.timeout(640)
def test_ep4_and_dp2_x_ep2_equal_one_process_with_expert_gradients_reduced_over_dp_only(ep4):
    claims = assert_claims(ep4, ROUTING | LAYER | EP | EP_DP | BALANCE | TORCH)
    assert ep4["grid_2d"] == [
        "dp=2 x ep=2 = 4 ranks",
        "dp groups: [0, 2] [1, 3]",
        "ep groups: [0, 1] [2, 3]",
    ]
    assert len(ep4["rows_sent"]) == 4
    assert claims["all_to_alls_forward_backward"]["value"] == 1
    assert ep4["busiest_rank_over_mean"] >= 1.0
    assert (
        ep4["ep_dp_test_loss_ratio"] < 1.0
    )  # 10 steps: it falls, by less than the claim's 10% guarantee


@pytest.mark.timeout(300)
def test_the_balance_loss_evens_the_histogram_on_every_seed(one_process):
    ratios = one_process["balance_imbalance"]
    assert all(a < b for a, b in zip(ratios["0.1"], ratios["0.0"]))
    assert one_process["claims"]["balance_loss_evens_the_histogram"]["value"] == 3


@pytest.mark.timeout(120)
def test_an_expert_no_rank_reached_keeps_grad_none_so_momentum_does_not_move_it(tmp_path):
    """As one process leaves it: a zero gradient would move it by lr x momentum x the last step's buffer."""
    for r in run_world(unreached_expert_after_momentum, 2, tmp_path):
        assert r["grad_is_none"] == [False, True]  # expert 0: reached on rank 0, so reduced on both
        assert r["moved"][1] == 0.0 and r["moved"][0] > 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--experts", "3"], "--experts 3 must be divisible by ep = 2"),
        (["--top-k", "5"], "--top-k 5 must be between 1"),
        (["--capacity-factor", "0"], "--capacity-factor must be in (0, 1000]"),
    ],
)
def test_bad_input_fails_on_every_rank(args, message):
    run = run_lesson(LESSON, nproc=2, args=args, timeout_s=180)
    assert run.returncode != 0
    assert_fails_on_every_rank(run, 2, message)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("launch", ["one_process_run", "ep2_run", "ep4_run"])
def test_printed_lines_fit_at_the_defaults(launch, request):
    assert_lines_fit(request.getfixturevalue(launch))
