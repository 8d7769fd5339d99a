"""Lesson 18 (gradient compression): what a comm hook receives, the hand-written fp16 / bf16 hook against
PyTorch's, PowerSGD's bytes, warm start and error feedback, the accuracy each hook costs, the exact resume. One
2-rank launch (shared with the notebook and the minimal script's test), one plain-python launch, and one small
world in which a NaN planted on rank 1 fails the equality claim; no assertion reads a time."""

import math

import pytest

from common.run.launch import run_lesson
from tests._lessons import assert_claims, assert_fails_on_every_rank, assert_lines_fit
from tests._workers import run_world

LESSON = "18_gradient_compression"
PARAM_BYTES = 2_182_184  # ResidualMLP(256, 4): 545,546 fp32 parameters
TWO_RANK_CLAIMS = {
    "buckets_hold_every_gradient",
    "fp16_hook_equals_pytorchs",
    "bf16_hook_equals_pytorchs",
    "fp16_hook_halves_bytes",
    "bf16_hook_halves_bytes",
    "fp16_error_within_rounding",
    "bf16_error_within_rounding",
    "powersgd_bytes_are_p_and_q",
    "powersgd1_cuts_bytes_10x",
    "warm_start_reaches_best_rank1",
    "fresh_q_stays_above_best_rank1",
    "error_feedback_beats_best_rank1",
    "default_hook_learns",
    "fp16_accuracy_change",
    "bf16_accuracy_change",
    "powersgd1_accuracy_change",
    "powersgd4_accuracy_change",
    "powersgd_resume_exact",
}


@pytest.fixture(scope="module")
def two_ranks_run():
    return run_lesson(LESSON, nproc=2, timeout_s=480).check()


@pytest.fixture(scope="module")
def two_ranks(two_ranks_run):
    return two_ranks_run.results


def _claims(r):
    return {name: c["value"] for name, c in r["claims"].items()}


@pytest.mark.timeout(600)
def test_two_ranks_claims_hold(two_ranks_run, two_ranks):
    assert set(assert_claims(two_ranks, TWO_RANK_CLAIMS)) == TWO_RANK_CLAIMS
    assert_lines_fit(two_ranks_run)


@pytest.mark.timeout(600)
def test_bytes_and_errors_per_hook(two_ranks):
    rows = {row["hook"]: row for row in two_ranks["hooks"]}
    assert list(rows) == ["allreduce", "fp16", "bf16", "powersgd1", "powersgd2", "powersgd4"]
    assert rows["allreduce"]["bytes"] == PARAM_BYTES and rows["allreduce"]["error"] == 0.0
    assert rows["fp16"]["bytes"] == rows["bf16"]["bytes"] == PARAM_BYTES // 2
    # PowerSGD: biases (2,314 floats) as they are + P and Q of each matrix: (4,682 floats) x rank
    for rank in (1, 2, 4):
        assert rows[f"powersgd{rank}"]["bytes"] == 4 * (2314 + 4682 * rank)
    errors = [rows[h]["error"] for h in ("fp16", "bf16", "powersgd4", "powersgd2", "powersgd1")]
    assert errors == sorted(errors), errors  # fewer bytes, more error
    ratios = [two_ranks[f"powersgd{k}_bytes_ratio"] for k in (1, 2, 4)]
    assert ratios == sorted(ratios, reverse=True) and ratios[0] >= 10


@pytest.mark.timeout(600)
def test_training_bytes_and_accuracy(two_ranks):
    rows = {row["hook"]: row for row in two_ranks["training"]}
    assert rows["allreduce"]["bytes_per_step"] == PARAM_BYTES
    assert rows["fp16"]["bytes_per_step"] == rows["bf16"]["bytes_per_step"] == PARAM_BYTES // 2
    for rank in (1, 2, 4):
        assert rows[f"powersgd{rank}"]["bytes_per_step"] == 4 * (2314 + 4682 * rank)
    assert rows["allreduce"]["accuracy"] >= 0.85
    assert abs(rows["bf16"]["accuracy"] - rows["allreduce"]["accuracy"]) <= 0.02


@pytest.mark.timeout(600)
def test_a_powersgd_run_resumes_exactly_only_with_its_hook_state_and_rebuilt_buckets(two_ranks):
    """The exact resume ends 0.0 from the uninterrupted run; model + optimizer alone, or the pickled hook state
    added to a bucket laid out in parameter order (a new DDP's first backward), do not."""
    assert _claims(two_ranks)["powersgd_resume_exact"] == 0.0
    assert two_ranks["powersgd_resume_model_and_optimizer"] > 1e-3
    assert two_ranks["powersgd_resume_pickled_hook_state"] > 1e-3


@pytest.mark.timeout(120)
def test_a_nan_on_rank_1_fails_the_equality_claim(tmp_path):
    """The hand-written hook's result with a NaN on rank 1 only: the equality with PyTorch's hook and the
    rounding bound do not hold, on every rank (the difference is NaN-safe over ranks), the byte count does."""
    from tests._18_workers import cast_claims_with_nan_on_rank1

    for r in run_world(cast_claims_with_nan_on_rank1, 2, tmp_path):
        for kind in ("fp16", "bf16"):
            value, holds = r["claims"][f"{kind}_hook_equals_pytorchs"]
            assert math.isnan(value) and not holds
        assert sorted(r["failing"]) == sorted(
            f"{k}_{what}"
            for k in ("fp16", "bf16")
            for what in ("hook_equals_pytorchs", "error_within_rounding")
        )


@pytest.mark.timeout(120)
def test_a_hook_that_sends_fp32_fails_the_byte_and_equality_claims(tmp_path):
    """The bytes are counted from the all-reduces the hook issued, not from a dtype's size: a hook that sends
    the fp32 buffer fails `*_halves_bytes` (and, sending other values, the equality with PyTorch's hook)."""
    from tests._18_workers import cast_claims_with_an_fp32_hook

    for r in run_world(cast_claims_with_an_fp32_hook, 2, tmp_path):
        assert sorted(r["failing"]) == sorted(
            f"{k}_{what}"
            for k in ("fp16", "bf16")
            for what in ("hook_equals_pytorchs", "hook_halves_bytes")
        )
        assert r["claims"]["fp16_hook_halves_bytes"][0] < 0  # plain - 2 x plain: nothing saved


@pytest.mark.timeout(400)
def test_one_process_trains_without_a_hook():
    run = run_lesson(LESSON, nproc=None, timeout_s=360).check()
    assert set(assert_claims(run.results, {"default_hook_learns"})) == {"default_hook_learns"}
    assert [row["bytes_per_step"] for row in run.results["training"]] == [0]
    assert "one process: no bucket to send" in run.stdout
    assert_lines_fit(run)


@pytest.mark.timeout(240)
def test_bad_input_fails_on_every_rank():
    run = run_lesson(LESSON, nproc=2, args=["--steps", "2"], timeout_s=180)
    assert_fails_on_every_rank(
        run, 2, "--steps >= 3 (PowerSGD compresses from step 3 on); got --steps 2"
    )
