"""Lesson 07: gradient accumulation under DDP, launched once with 2 ranks and once as plain python.

Every number is a claim the lesson records; the tests assert the claims by name, that every recorded claim
holds, and the tolerances the lesson states. The batch arithmetic and the variants in one process are unit tests
(tests/unit/test_accumulation.py).
"""

from __future__ import annotations

import math

import pytest

from common.run.launch import run_lesson
from tests._lessons import DEV, assert_claims, assert_fails_on_every_rank, assert_lines_fit
from tests._nan_on_rank1 import failing_claims, launch_with_nan_on_rank1

LESSON = "07_gradient_accumulation"
TOL = 1e-5
FAST = [*DEV, "--steps", "20"]

ONE_PROCESS_EXACT = ["accumulate", "uneven_sample_weighted", "clip_after_sync"]
DDP_EXACT = ["require_grad_sync", "always_sync", "backward_only_no_sync"]
WRONG = ["no_divide", "running_divide", "uneven_mean_over_k", "clip_each_micro_step"]
COMMON = (
    {f"{v}_equals_global_step" for v in ONE_PROCESS_EXACT}
    | {f"{v}_changes_the_step" for v in WRONG}
    | {
        "no_divide_clip_params_equal",
        "no_divide_clip_grads_differ",
        "train_loss_falls",
        "max_param_diff_across_ranks",
        "training_loop_equals_one_process_replay",
    }
)


@pytest.fixture(scope="module")
def two_ranks_run():
    """The notebook's command on a CPU machine: 2 ranks, 20 steps."""
    return run_lesson(LESSON, nproc=2, args=FAST, timeout_s=480).check()


@pytest.fixture(scope="module")
def one_process_run():
    return run_lesson(LESSON, nproc=None, args=FAST, timeout_s=480).check()


@pytest.fixture(scope="module")
def two_ranks(two_ranks_run):
    return two_ranks_run.results


@pytest.fixture(scope="module")
def one_process(one_process_run):
    return one_process_run.results


@pytest.mark.timeout(600)
@pytest.mark.parametrize("which", ["two_ranks_run", "one_process_run"])
def test_printed_lines_fit(which, request):
    assert_lines_fit(request.getfixturevalue(which))


def _claims(r):
    return {name: c["value"] for name, c in r["claims"].items()}


@pytest.mark.timeout(600)
def test_two_ranks_accumulation_equals_one_global_step(two_ranks):
    r = two_ranks
    assert (r["world_size"], r["global_batch"], r["micro_batch"], r["grad_accum_steps"]) == (
        2,
        16,
        2,
        4,
    )
    assert_claims(
        r,
        COMMON
        | {f"{v}_equals_global_step" for v in DDP_EXACT}
        | {f"{v}_allreduce_calls" for v in ["accumulate", *DDP_EXACT]}
        | {
            "buckets",
            "bucket_bytes_equal_parameter_bytes",
            "comm_by_k_rows_off",
            "train_allreduce_calls_per_step",
        },
    )
    c = _claims(r)
    for v in ONE_PROCESS_EXACT + DDP_EXACT:  # gradients and parameters within rounding
        assert c[f"{v}_equals_global_step"] < TOL, v
    for v in WRONG:  # each wrong scaling moves the parameters by far more than rounding
        assert c[f"{v}_changes_the_step"] > 100 * TOL, v
    # Not dividing by k: the gradient is k times too large, but clipping caps the norm in the same direction,
    # so the parameters agree while the gradient does not.
    assert c["no_divide_clip_params_equal"] < TOL and c["no_divide_clip_grads_differ"] > 100 * TOL
    assert r["uneven_sizes"] == [5, 1, 1, 1]


@pytest.mark.timeout(600)
def test_one_process_accumulation_equals_one_global_step(one_process):
    r = one_process
    # Same 16-sample global batch at world size 1: 8 micro-steps of 2.
    assert (r["world_size"], r["global_batch"], r["micro_batch"], r["grad_accum_steps"]) == (
        1,
        16,
        2,
        8,
    )
    claims = assert_claims(r, COMMON)
    c = _claims(r)
    for v in ONE_PROCESS_EXACT:
        assert c[f"{v}_equals_global_step"] < TOL, v
    for v in WRONG:
        assert c[f"{v}_changes_the_step"] > 100 * TOL, v
    assert "comm_by_k" not in r and "buckets" not in claims  # no process group, no all-reduce


@pytest.mark.timeout(600)
def test_allreduce_counts(two_ranks):
    c, k = _claims(two_ranks), two_ranks["grad_accum_steps"]
    buckets = c["accumulate_allreduce_calls"]
    assert buckets == c["buckets"] >= 1
    assert c["require_grad_sync_allreduce_calls"] == buckets
    assert c["always_sync_allreduce_calls"] == k * buckets
    # no_sync() around the backward only (README myth 8): the forward outside armed the reducer, so every
    # micro-step syncs.
    assert c["backward_only_no_sync_allreduce_calls"] == k * buckets
    param_bytes = 4 * two_ranks["n_params"]
    assert (
        c["bucket_bytes_equal_parameter_bytes"] == param_bytes
    )  # exact: each gradient once, none twice
    rows = two_ranks[
        "comm_by_k"
    ]  # (k, calls, bytes) with no_sync, (calls, bytes) syncing every micro-step
    assert [row[0] for row in rows] == [1, 2, 4, 8]
    for kk, calls, nbytes, every_calls, every_bytes in rows:
        assert calls == buckets and nbytes == param_bytes
        assert every_calls == kk * calls and every_bytes == kk * nbytes
    assert c["comm_by_k_rows_off"] == 0
    assert c["train_allreduce_calls_per_step"] == buckets


@pytest.mark.timeout(600)
@pytest.mark.parametrize("which", ["two_ranks", "one_process"])
def test_training_loop_equals_one_process_replay(which, request):
    """the training LOOP (not only the proof functions) is checked against a one-process replay
    of its global batches; dividing the loss by micro_step + 1 in the loop makes this fail (5.6e-02)."""
    r = request.getfixturevalue(which)
    c = r["claims"]["training_loop_equals_one_process_replay"]
    assert c["bound"] == TOL and c["value"] < TOL and c["holds"]
    hist = r["history"]
    assert hist[-1]["train_loss"] < hist[0]["train_loss"] - 0.2
    assert r["claims"]["max_param_diff_across_ranks"]["value"] == 0.0
    assert 0.0 < r["final_test_accuracy"] <= 1.0


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--grad-accum-steps", "0"], "--grad-accum-steps must be a positive integer, got 0"),
        (
            ["--global-batch", "10", "--micro-batch", "2"],
            "--global-batch 10 is not divisible by --micro-batch x world_size = 2 x 2 = 4",
        ),
        (
            ["--micro-batch", "1", "--global-batch", "8"],
            "need --micro-batch >= 2 (got 1)",
        ),  # no uneven split
    ],
)
def test_bad_input_fails_on_every_rank(args, message):
    assert_fails_on_every_rank(run_lesson(LESSON, nproc=2, args=args, timeout_s=180), 2, message)


@pytest.mark.timeout(360)
def test_a_nan_on_rank_1_alone_fails_max_param_diff_across_ranks():
    """Rank 1's replica holds a NaN while the lesson compares the replicas after training
    (tests/_nan_on_rank1.py): the claim does not hold and the lesson exits 1."""
    run = launch_with_nan_on_rank1(LESSON, FAST)
    assert run.returncode == 1, run.stdout + run.stderr
    failing = failing_claims(run)
    assert list(failing) == ["max_param_diff_across_ranks"], failing
    assert math.isnan(failing["max_param_diff_across_ranks"])
