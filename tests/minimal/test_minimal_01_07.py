"""minimal/01-07 held to their lessons: launched as users launch them, the same numbers at the same seed, or
(for what a script builds by hand) equal to PyTorch's own, checked by the script itself.

Every launch runs on CPU (the minimal scripts with CUDA_VISIBLE_DEVICES="", the lessons with --device cpu), so
both choose gloo and the comparison does not depend on GPU kernels.
"""

from __future__ import annotations

import json
import re

import pytest

from common.run.launch import run_lesson
from common.run.processes import REPO_ROOT

CPU = {"CUDA_VISIBLE_DEVICES": ""}
TIMEOUT_S = 480
TOL = 1e-6  # the loss history equal within 1e-6 (measured: 0.0 for 01, 03, 04, 07; 6e-8 for 06)


def minimal(name: str, nproc: int | None = 2, args: list[str] = ()) -> tuple[list[dict], str]:
    """Launch minimal/<name>.py (nproc None: plain python), check exit 0; return its JSON lines and stdout."""
    run = run_lesson(
        REPO_ROOT / "minimal" / f"{name}.py", nproc, list(args), TIMEOUT_S, env=CPU, results=False
    ).check()
    return [
        json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")
    ], run.stdout


def lesson(name: str, nproc: int | None = 2, args: list[str] = ()) -> tuple[dict, str]:
    """Launch lessons/<name>.py on CPU (--device cpu: the command notebook NN runs, so one launch serves both)."""
    run = run_lesson(name, nproc, ["--device", "cpu", *args], TIMEOUT_S).check()
    return run.results, run.stdout


def assert_same_losses(got: list[dict], history: list[dict], key: str = "train_loss") -> None:
    """One JSON line per epoch from the script, one history entry per epoch from the lesson: equal within TOL."""
    assert [g["epoch"] for g in got] == [h["epoch"] for h in history]
    for g, h in zip(got, history):
        assert abs(g[key] - h["train_loss"]) <= TOL, (g, h)  # NaN makes this fail


@pytest.fixture(scope="module")
def lesson03_2():
    """lessons/03_ddp.py, 2 processes, 2 epochs: the numbers minimal/03, 04 and 07 (k = 1) reproduce."""
    return lesson("03_ddp", 2, ["--epochs", "2"])[0]


@pytest.mark.timeout(1200)
def test_01_reproduces_lesson_01():
    results, _ = lesson("01_single_gpu", None, ["--epochs", "2"])
    got, stdout = minimal("01_single_gpu", None, ["--epochs", "2"])
    assert_same_losses(got, results["history"])
    test_loss = float(re.search(r"test loss (\S+)", stdout).group(1))  # printed with 4 decimals
    assert abs(test_loss - results["history"][-1]["test_loss"]) <= 5e-5


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("nproc", [None, 2, 4])
def test_02_collectives_and_ring_equal_pytorch(nproc):
    lengths = ["4", "7", "1001"]  # 7 and 1001 do not divide by 2 or 4: chunks of unequal length
    _, stdout = minimal("02_collectives", nproc, ["--lengths", *lengths])
    n = nproc or 1
    assert f"all checks hold on {n} rank(s)" in stdout
    assert (
        f"all_gather      rank 0 received {[[float(100 * k + i) for i in range(4)] for k in range(n)]}"
        in stdout
    )


@pytest.mark.timeout(1200)
def test_03_reproduces_lesson_03_on_2_processes(lesson03_2):
    got, _ = minimal("03_ddp", 2, ["--epochs", "2"])  # exit 0: its check (replicas identical) held
    assert_same_losses(got, lesson03_2["history"])


@pytest.mark.timeout(1200)
def test_03_plain_python_reproduces_lesson_03_plain_python():
    results, _ = lesson("03_ddp", None, ["--epochs", "1"])
    got, _ = minimal("03_ddp", None, ["--epochs", "1"])  # a process group of one: the same numbers
    assert_same_losses(got, results["history"])


@pytest.mark.timeout(1200)
def test_04_sampler_by_hand_trains_like_distributed_sampler(lesson03_2):
    # exit 0: its indices equal DistributedSampler's (1 to 4 ranks); so the training is lesson 03's
    got, _ = minimal("04_custom_sampler", 2, ["--epochs", "2"])
    assert_same_losses(got, lesson03_2["history"])


@pytest.mark.timeout(1200)
def test_05_unpadded_evaluation_and_join_reproduce_lesson_05():
    results, stdout = lesson("05_uneven_data", 2)
    got, _ = minimal(
        "05_uneven_data", 2, ["--epochs", "1"]
    )  # exit 0: replicas identical after Join
    evaluation, epoch = got
    assert abs(evaluation["test_loss"] - results["eval_unpadded"]["loss"]) <= TOL
    assert abs(evaluation["test_accuracy"] - results["eval_unpadded"]["accuracy"]) <= TOL
    assert results["join_steps"] == [4, 5]  # the shards minimal/05 cuts too: 4 + rank batches of 16
    join_loss = float(
        re.search(r"mean training loss (\S+)", stdout).group(1)
    )  # printed with 4 decimals
    assert abs(epoch["train_loss"] - join_loss) <= 5e-5


@pytest.mark.timeout(1200)
def test_06_sync_batchnorm_reproduces_lesson_06():
    # one epoch of 23 steps of 2 x 32 samples in both; exit 0: SyncBatchNorm2d equals BatchNorm2d on the
    # global batch (input gradients and running statistics)
    results, _ = lesson("06_sync_batchnorm", 2, ["--max-steps", "0", "--batch-size", "32"])
    got, _ = minimal("06_sync_batchnorm", 2, ["--epochs", "1"])  # 32 samples per process
    syncbn = results["variants"]["syncbn"]
    assert syncbn["steps"] == 23
    assert (
        abs(got[0]["last_loss"] - syncbn["final_loss"]) <= TOL
    )  # rank 0's last step, after 23 steps


@pytest.mark.timeout(1200)
def test_07_accumulation_equals_one_step_and_k1_is_lesson_03(lesson03_2):
    minimal(
        "07_gradient_accumulation", 2, ["--epochs", "1"]
    )  # exit 0: k = 2 micro-steps == one step
    got, _ = minimal("07_gradient_accumulation", 2, ["--epochs", "2", "--grad-accum-steps", "1"])
    assert_same_losses(got, lesson03_2["history"])


@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    "name", ["04_custom_sampler", "05_uneven_data", "06_sync_batchnorm", "07_gradient_accumulation"]
)
def test_plain_python_world_of_one(name):
    got, _ = minimal(name, None, ["--epochs", "1"])  # exit 0: the script's own check holds
    assert got
