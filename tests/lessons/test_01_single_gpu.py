"""Lesson 01 launched as a user runs it: plain python, and torchrun (each process alone)."""
from __future__ import annotations

import pytest

from common.launch import run_lesson


@pytest.mark.timeout(240)
def test_baseline_learns_and_resume_equals_uninterrupted(tmp_path):
    full = run_lesson("01_single_gpu", nproc=None, timeout_s=180).check().results
    assert full["final_test_accuracy"] >= 0.95
    assert full["test_count"] == 359
    losses = [h["train_loss"] for h in full["history"]]
    assert losses[-1] < 0.5 * losses[0]  # the loss actually falls
    assert all(s > 0 for s in full["samples_per_s"])

    ckpt = tmp_path / "ckpt.pt"
    first = run_lesson("01_single_gpu", None, ["--epochs", "2", "--checkpoint", str(ckpt)], 180).check()
    assert ckpt.is_file() and len(first.results["history"]) == 2
    resumed = run_lesson("01_single_gpu", None, ["--checkpoint", str(ckpt), "--resume"], 180).check()
    assert "resumed from" in resumed.stdout
    assert [h["epoch"] for h in resumed.results["history"]] == [3, 4]
    assert resumed.results["history"] == full["history"][2:]   # same numbers as never having stopped


@pytest.mark.timeout(240)
def test_under_torchrun_each_process_trains_alone():
    run = run_lesson("01_single_gpu", nproc=2, args=["--epochs", "1"], timeout_s=180).check()
    assert "one of 2 independent processes" in run.stdout
    assert run.stdout.count("final test_loss") == 1  # only rank 0 prints


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, message", [(["--batch-size", "0"], "--batch-size must be a positive integer"),
                                           (["--epochs", "-1"], "--epochs must be >= 0"),
                                           (["--data", "no/such/file.npz"], "data file not found"),
                                           (["--resume"], "--resume needs --checkpoint")])
def test_bad_input_is_one_clear_line(args, message):
    run = run_lesson("01_single_gpu", nproc=None, args=args, timeout_s=60)
    assert run.returncode == 2
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert errors == [f"error: {errors[0].split('error: ', 1)[1]}"] and message in errors[0]
    assert "Traceback" not in run.stderr
