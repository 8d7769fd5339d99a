"""minimal/08-11, 13 and 16 held to their lessons: launched as users launch them (torchrun, or plain python),
the same numbers as the measured lesson at the same seed, or, for what a script builds by hand, equal to
PyTorch's own (the script checks that itself and exits non-zero otherwise; the test reads its JSON line).

Every launch runs on CPU (the minimal scripts with CUDA_VISIBLE_DEVICES="", the lessons with --device cpu), so
both choose gloo.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from common.harness.grid import grid_layout
from common.run.launch import run_lesson
from common.run.processes import REPO_ROOT
from common.tensor_parallel.layers import MLP

CPU = {"CUDA_VISIBLE_DEVICES": ""}
TIMEOUT_S = 480
TOL = 1e-6  # a lesson's numbers reproduced within 1e-6


def minimal(name: str, nproc: int | None = 2, args: list[str] = ()) -> list[dict]:
    """Launch minimal/<name>.py (nproc None: plain python); exit 0 (its own check held); its JSON lines."""
    run = run_lesson(
        REPO_ROOT / "minimal" / f"{name}.py", nproc, list(args), TIMEOUT_S, env=CPU, results=False
    ).check()
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, run.stdout
    return lines


def lesson(name: str, nproc: int | None = 2, args: list[str] = ()) -> dict:
    """Launch lessons/<name>.py on CPU (--device cpu: the command notebook NN runs, so one launch serves both)."""
    return run_lesson(name, nproc, ["--device", "cpu", *args], TIMEOUT_S).check().results


def close(a: float, b: float, tol: float = TOL) -> bool:
    return abs(a - b) <= tol  # False for NaN


# ------------------------------------------------------------------------------------------ 08 memory
@pytest.mark.timeout(1200)
def test_08_activation_bytes_are_lesson_08s():
    want = lesson("08_memory", 2)["saved_activation_bytes"]  # micro-batch 128, width 256, depth 4
    for nproc in (2, None):  # bytes per rank do not depend on the number of ranks
        (got,) = minimal("08_memory", nproc)
        for key in ("plain", "checkpointing", "bf16 autocast"):
            assert got["saved_bytes"][key] == want[key], (key, got, want)  # integers: exactly
        assert got["checkpointing_max_grad_diff"] <= 1e-5  # lesson 08's bound (measured 0.0)
        assert (
            abs(got["checkpointing_share"] - 0.44) <= 0.01
        )  # 56% fewer bytes, as lesson 08 states


# ------------------------------------------------------------------------------------------ 09 GPipe
@pytest.mark.timeout(1200)
def test_09_gpipe_loss_is_lesson_09s_and_equals_the_unsplit_model():
    results = lesson(
        "09_model_parallel", 2, ["--schedules", "gpipe", "--microbatches", "4", "--stage-ms", "0"]
    )
    want = results["step_gpipe_m4"]["loss"]  # the same model, batch and seed
    for nproc in (2, None):
        (got,) = minimal("09_model_parallel", nproc, ["--microbatches", "4"])
        assert (got["stages"], got["microbatches"]) == (nproc or 1, 4)
        assert close(got["loss"], want), (got, want)
        assert (
            got["max_diff"] <= 1e-5
        )  # lesson 09's bound: loss and gradients = the unsplit model's


@pytest.mark.timeout(1200)
def test_09_gpipe_with_uneven_micro_batches_equals_the_unsplit_model():
    (got,) = minimal("09_model_parallel", 2, ["--microbatches", "5"])  # 32 = 7 + 7 + 7 + 7 + 4
    assert got["max_diff"] <= 1e-5


# ------------------------------------------------------------------------------------------ 10 tensor parallel
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("nproc", [None, 2, 4])
def test_10_split_mlp_equals_the_unsplit_one_with_one_all_reduce_each_way(nproc):
    (got,) = minimal("10_tensor_parallel", nproc)
    assert got["tp"] == (nproc or 1)
    assert got["all_reduces"] == {"forward": 1, "backward": 1}  # g forward, f backward
    assert got["max_diff"] <= 1e-5  # lesson 10's bound: output, input and weight gradients
    # the same x and unsplit MLP as lesson 10's hand-built section (set_seed(0), randn(B, S, H), MLP(H))
    torch.manual_seed(0)
    x = torch.randn(32, 8, 32)
    assert close(got["loss"], MLP(32)(x).square().mean().item())


# ------------------------------------------------------------------------------------------ 11 hybrid
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("nproc, dp, tp", [(4, 2, 2), (2, 1, 2), (None, 1, 1)])
def test_11_dp_x_tp_grid_equals_one_process(nproc, dp, tp):
    (got,) = minimal("11_hybrid_parallel", nproc)
    assert (got["dp"], got["tp"]) == (dp, tp)
    layout = grid_layout({"dp": dp, "tp": tp})  # the layout lesson 11's Grid uses
    assert got["tp_groups"] == layout.tolist() and got["dp_groups"] == layout.t().tolist()
    assert (
        got["max_diff"] <= 1e-5
    )  # lesson 11's bound: every parameter = one process on the global batch


@pytest.mark.timeout(1200)
def test_11_refuses_a_dp_that_does_not_divide_the_global_batch():
    """3 ranks: tp = 1, dp = 3, and 32 images would split 11 + 11 + 10, whose mean of means is not the batch
    mean (8.9e-4 from one process): one line on every rank, non-zero exit, no check run."""
    run = run_lesson(
        REPO_ROOT / "minimal" / "11_hybrid_parallel.py", 3, [], TIMEOUT_S, env=CPU, results=False
    )
    assert run.returncode != 0, run.stdout
    lines = [
        line
        for line in run.stderr.splitlines()
        if line == "dp = 3 must divide the global batch of 32 (3 processes)"
    ]
    assert len(lines) == 3 and "max_diff" not in run.stdout, run.stderr


# ------------------------------------------------------------------------------------------ 13 ZeRO
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("nproc", [None, 2, 4])
def test_13_zero_stages_equal_ddp_with_1_over_n_of_adams_state(nproc):
    got = minimal("13_sharded_data_parallel", nproc)
    n = nproc or 1
    assert [g["stage"] for g in got] == [1, 2, 3]
    for g in got:
        assert g["max_diff"] <= 1e-6  # lesson 13's bound against DDP
        assert (
            g["adam_state_bytes"] / g["ddp_adam_state_bytes"] <= 1 / n + 0.01
        )  # lesson 13's bound
        assert g["losses"] == got[0]["losses"] and all(math.isfinite(v) for v in g["losses"])


# ------------------------------------------------------------------------------------------ 16 fault tolerance
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("nproc", [None, 2])
def test_16_resumed_run_equals_the_uninterrupted_one_bit_for_bit(nproc):
    (got,) = minimal("16_fault_tolerance", nproc)  # dropout on: every rank's random stream matters
    assert got["max_diff"] == 0.0  # lesson 16's claim at 2 ranks: 0.0


@pytest.mark.timeout(1200)
def test_16_resumed_run_on_3_ranks_is_within_lesson_16s_bound():
    """On 3+ ranks the resumed DDP's first step reduces a bucket laid out otherwise than the uninterrupted
    run's, so gloo's ring adds in another order: 1.5e-8 measured, lesson 16's bound 1e-6 (exit 0: it held)."""
    (got,) = minimal("16_fault_tolerance", 3)
    assert 0.0 <= got["max_diff"] <= 1e-6
    assert len(got["losses"]) == 18


@pytest.mark.timeout(1200)
def test_16_resumed_losses_are_lesson_16s_uninterrupted_losses():
    results = lesson("16_fault_tolerance", 2, ["--no-random-draws"])
    (attempt,) = results["timeline"]["attempts"]
    (got,) = minimal("16_fault_tolerance", 2, ["--dropout", "0"])  # no random draws, as the lesson
    assert got["max_diff"] == 0.0
    assert len(got["losses"]) == len(attempt["losses"]) == 18
    assert (
        got["losses"] == attempt["losses"]
    )  # bit for bit: stopped at 10, resumed, = never stopped
