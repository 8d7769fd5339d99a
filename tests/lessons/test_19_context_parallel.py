"""Lesson 19: context parallelism at cp = 2 and 4 (and as one process): ring attention equal to SDPA forward
and backward, the bytes each rank sends, exact causal work per rank (contiguous vs zig-zag), training with cp
equal to one process, Ulysses; bad input refused on every rank."""

from __future__ import annotations

import pytest

from common.context_parallel.ring_attention import causal_pairs
from common.run.launch import run_lesson
from tests._lessons import assert_claims, assert_fails_on_every_rank, assert_lines_fit

LESSON = "19_context_parallel"
S, H = 64, 8  # --seq-len's and --heads' defaults
MEMORY = {
    "naive_attention_bytes_grow_with_s_squared",
    "ring_saved_bytes_per_rank",
    "ring_saved_bytes_fall_with_cp",
}
RING = {
    "ring_zigzag_equals_sdpa",
    "ring_contiguous_equals_sdpa",
    "ring_forward_bytes_sent",
    "ring_backward_bytes_sent",
    "ring_holds_rank_r_minus_s",
}
WORK = {
    "pairs_contiguous_total",
    "pairs_zigzag_total",
    "pairs_contiguous_max_over_min",
    "pairs_zigzag_max_over_min",
}
TRAIN = {"training_follows_one_process", "training_params_equal_one_process", "training_loss_falls"}
ULYSSES = {"ulysses_equals_sdpa", "ulysses_all_to_alls", "ulysses_forward_bytes_sent"}
ALL = MEMORY | RING | WORK | TRAIN | ULYSSES


@pytest.fixture(scope="module")
def cp2_run():
    return run_lesson(LESSON, nproc=2, timeout_s=480).check()


@pytest.fixture(scope="module")
def cp4_run():
    return run_lesson(LESSON, nproc=4, timeout_s=480).check()


@pytest.fixture(scope="module")
def one_process_run():
    return run_lesson(LESSON, nproc=None, timeout_s=240).check()


@pytest.fixture(scope="module")
def cp2(cp2_run):
    return cp2_run.results


@pytest.fixture(scope="module")
def cp4(cp4_run):
    return cp4_run.results


@pytest.fixture(scope="module")
def one_process(one_process_run):
    return one_process_run.results


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_sdpa_and_sends_cp_minus_1_blocks(cp, cp2, cp4):
    results = {2: cp2, 4: cp4}[cp]
    claims = assert_claims(results, ALL)
    for kind in ("zigzag", "contiguous"):
        assert claims[f"ring_{kind}_equals_sdpa"]["value"] <= 1e-5
    assert claims["ring_forward_bytes_sent"]["value"] == cp - 1
    assert claims["ring_backward_bytes_sent"]["value"] == 2 * cp - 1
    assert results["ring_held"] == [
        [(r - s) % cp for s in range(cp)] for r in range(cp)
    ]  # 1, 0, cp-1, ...
    assert claims["ring_holds_rank_r_minus_s"]["value"] == 0
    assert claims["ring_saved_bytes_per_rank"]["value"] == 2 * H * (S // cp) * 33 * 4
    assert claims["ulysses_forward_bytes_sent"]["value"] == 4 * (cp - 1) / cp
    assert "context_parallel" not in claims  # what PyTorch's version did is a value, never a claim
    assert isinstance(results["pytorch_context_parallel"], str)


@pytest.mark.timeout(600)
def test_zigzag_balances_causal_work_exactly_and_contiguous_does_not(cp4):
    c = S // 4
    assert cp4["pairs_contiguous"] == [
        r * c * c + causal_pairs(c) for r in range(4)
    ]  # 136, 392, 648, 904
    assert cp4["pairs_zigzag"] == [causal_pairs(S) // 4] * 4
    assert cp4["claims"]["pairs_zigzag_max_over_min"]["value"] == 1.0
    assert cp4["claims"]["pairs_contiguous_max_over_min"]["value"] == 904 / 136
    assert set(cp4["idle_contiguous"]) and len(cp4["idle_zigzag"]) == 4  # measured, not claimed


@pytest.mark.timeout(600)
def test_training_with_cp_follows_one_process_and_the_token_mean_is_exact(cp4):
    losses = cp4["losses"]
    assert len(losses["cp"]) == len(losses["one_process"]) == 30
    assert max(abs(a - b) for a, b in zip(losses["cp"], losses["one_process"])) <= 1e-5
    assert losses["cp"][-1] < losses["cp"][0]
    assert cp4["targets_per_rank"] == [
        32 * 15,
        32 * 16,
        32 * 16,
        32 * 16,
    ]  # rank 0 holds the last token
    assert cp4["mean_of_means_error"] > 1e-5  # what averaging per-rank means would have cost


@pytest.mark.timeout(300)
def test_one_process_is_the_whole_sequence(one_process):
    claims = assert_claims(one_process, ALL)
    assert claims["ring_forward_bytes_sent"]["value"] == 0
    assert claims["pairs_contiguous_max_over_min"]["value"] == 1.0
    assert claims["ulysses_all_to_alls"]["value"] == 0
    assert one_process["pytorch_context_parallel"].startswith("not tried")


@pytest.mark.timeout(240)
def test_a_head_count_cp_does_not_divide_fails_on_every_rank():
    run = run_lesson(LESSON, nproc=2, args=["--heads", "1"], timeout_s=180)
    assert_fails_on_every_rank(run, 2, "must divide the head count 1")


@pytest.mark.timeout(240)
def test_a_sequence_the_zigzag_split_cannot_cut_is_refused():
    run = run_lesson(LESSON, nproc=None, args=["--seq-len", "63"], timeout_s=180)
    assert run.returncode == 2, run.stderr
    assert "sequence length 63 is not divisible by 2 x cp = 2" in run.stderr, run.stderr


@pytest.mark.timeout(600)
@pytest.mark.parametrize("launch", ["one_process_run", "cp2_run", "cp4_run"])
def test_printed_lines_fit_at_the_defaults(launch, request):
    assert_lines_fit(request.getfixturevalue(launch))
