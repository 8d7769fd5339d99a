"""Lesson 01 launched as a user runs it: plain python (one process, one device; a launch of several processes is
refused with one line: they start in lesson 02)."""

from __future__ import annotations

import sys

import pytest

from common.run.launch import lesson_path, run_lesson
from common.run.processes import run_command
from tests._lessons import DEV, assert_claims, assert_fails_on_every_rank, assert_lines_fit

CLAIMS = {"loss_falls", "test_accuracy", "each_test_image_counted_once"}


@pytest.fixture(scope="module")
def full():
    """The default run, plus the in-run check that a run stopped at epoch 2 and resumed ends identical."""
    # without a GPU, notebook 01's command: the session launches it once
    args = [*DEV, "--check-resume"]
    return run_lesson("01_single_gpu", nproc=None, args=args, timeout_s=360).check()


@pytest.mark.timeout(480)
def test_baseline_learns(full):
    r = full.results
    claims = assert_claims(r, CLAIMS | {"resume_reproduces_uninterrupted"})
    assert claims["test_accuracy"]["value"] >= 0.95 and claims["test_accuracy"]["bound"] == 0.95
    assert claims["each_test_image_counted_once"]["value"] == 359
    assert claims["loss_falls"]["value"] <= 0.5
    losses = [h["train_loss"] for h in r["history"]]
    assert losses[-1] < 0.5 * losses[0]  # the loss actually falls
    assert all(s > 0 for s in r["samples_per_s"])
    assert "note:" not in full.stdout and r["world_size"] == 1
    assert_lines_fit(full)


@pytest.mark.timeout(480)
def test_resume_from_checkpoint_equals_uninterrupted(full, tmp_path):
    # in one run: every parameter and buffer bit-identical after stopping at epoch 2 and resuming
    assert full.results["claims"]["resume_reproduces_uninterrupted"]["value"] == 0.0
    # and as a user does it, in two launches
    ckpt = tmp_path / "ckpt.pt"
    first = run_lesson(
        "01_single_gpu", None, ["--epochs", "2", "--checkpoint", str(ckpt)], 180
    ).check()
    assert ckpt.is_file() and len(first.results["history"]) == 2
    resumed = run_lesson(
        "01_single_gpu", None, ["--checkpoint", str(ckpt), "--resume"], 180
    ).check()
    assert "resumed from" in resumed.stdout
    assert [h["epoch"] for h in resumed.results["history"]] == [3, 4]
    assert (
        resumed.results["history"] == full.results["history"][2:]
    )  # same numbers as never having stopped
    assert_claims(resumed.results, CLAIMS)


@pytest.mark.timeout(480)
def test_several_processes_are_refused_on_every_rank():
    run = run_lesson("01_single_gpu", nproc=2, timeout_s=360)
    assert_fails_on_every_rank(
        run, 2, "lesson 01 trains on one device in one process: run it with python"
    )


@pytest.mark.timeout(480)
def test_the_legacy_launchers_local_rank_is_not_an_option_here():
    """`python -m torch.distributed.launch` (lesson 03) appends --local-rank=N: lesson 01 takes no such option."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.launch",
        "--nproc_per_node=2",
        str(lesson_path("01_single_gpu")),
        "--epochs",
        "1",
    ]
    run = run_command(cmd, timeout_s=360)
    assert run.returncode != 0 and "unrecognized arguments: --local-rank" in run.stderr, run.stderr


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch-size", "0"], "--batch-size must be a positive integer"),
        (["--epochs", "-1"], "--epochs must be >= 0"),
        (["--data", "no/such/file.npz"], "data file not found"),
        (["--resume"], "--resume needs --checkpoint"),
    ],
)
def test_bad_input_is_one_clear_line(args, message):
    run = run_lesson("01_single_gpu", nproc=None, args=args, timeout_s=120)
    assert run.returncode == 2
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert errors == [f"error: {errors[0].split('error: ', 1)[1]}"] and message in errors[0]
    assert "Traceback" not in run.stderr
