"""Lesson 14: fault tolerance, under real torchrun restarts.

Each configuration is launched once (module fixtures). `PET_MAX_RESTARTS` is torchrun's environment form of
--max-restarts (every torchrun option reads PET_<NAME>), so `run_lesson` launches exactly the docstring's command.
The checkpoint file format, the sampler and the timeline are unit-tested in tests/unit/test_train_state.py.
"""
from __future__ import annotations

import pytest

from common.launch import run_lesson
from tests._lessons import assert_claims, assert_fails_on_every_rank

LESSON = "14_fault_tolerance"
EXACT = {"resumed_equals_uninterrupted", "loss_curve_equals_uninterrupted", "resume_exact_equals_uninterrupted",
         "resume_at_epoch_start_differs", "resume_without_optimizer_differs", "resume_without_rng_differs"}


def restarts(n: int) -> dict:
    return {"PET_MAX_RESTARTS": str(n)}


def attempts(r: dict) -> list[dict]:
    return r["timeline"]["attempts"]


@pytest.fixture(scope="module")
def crash_at_7():
    """The docstring's command: rank 1 os._exit()s in step 7, the first step of epoch 1 (6 steps per epoch)."""
    return run_lesson(LESSON, nproc=2, args=["--crash-at-step", "7", "--crash-rank", "1"], env=restarts(2),
                      timeout_s=90).check().results


@pytest.fixture(scope="module")
def five_faults():
    """One fault per attempt: mid-epoch crash, killed writer (mid-write), crash resuming at an epoch boundary,
    killed writer (before the rename), crash in the last step."""
    faults = ["exit@10:1", "mid-write@12", "exit@13:0", "before-rename@16", "exit@18:1"]
    return run_lesson(LESSON, nproc=2, args=["--fault", *faults], env=restarts(5), timeout_s=150).check().results


@pytest.mark.timeout(120)
def test_crash_restart_equals_uninterrupted_run(crash_at_7):
    r = crash_at_7
    claims = assert_claims(r, EXACT)
    for name in ("resumed_equals_uninterrupted", "loss_curve_equals_uninterrupted",
                 "resume_exact_equals_uninterrupted"):
        assert claims[name]["value"] == 0.0 and claims[name]["bound"] == 0.0, name  # bit for bit on 2 ranks
    a0, a1 = attempts(r)
    assert r["attempt"] == 1 and r["attempts"] == 2
    assert a0["fault"]["fault"] == "exit" and (a0["fault"]["step"], a0["fault"]["rank"]) == (7, 1)
    assert a0["steps"] == [1, 2, 3, 4, 5, 6] and [s for s, _ in a0["saves"]] == [4]
    assert a1["resumed_from"] == 4 and a1["steps"] == list(range(5, 19))  # resumed mid-epoch 0 (4 of 6 steps)
    assert r["timeline"]["steps_redone"] == [[5, 6]]
    assert r["resume_1"] == {"from": 4, "ignored": 0, "redone": [5, 6]}


@pytest.mark.timeout(200)
def test_every_fault_resumes_from_the_last_complete_checkpoint(five_faults):
    r = five_faults
    assert_claims(r, EXACT)
    assert r["claims"]["resumed_equals_uninterrupted"]["value"] == 0.0
    runs = attempts(r)
    assert [a["fault"]["fault"] for a in runs[:5]] == ["exit", "mid-write", "exit", "before-rename", "exit"]
    # exit@10 (mid-epoch 1) -> 8; the save at 12 killed mid-write -> 8 again, its temp file ignored;
    # exit@13 -> 12 (= the end of epoch 1: resume at an epoch boundary); the save at 16 killed before its rename
    # -> 12, its temp file ignored; exit@18 (the last step) -> 16.
    assert [a["resumed_from"] for a in runs[1:]] == [8, 8, 12, 12, 16]
    assert [len(a["ignored"]) for a in runs[1:]] == [0, 1, 0, 1, 0]
    assert all(name.startswith(".step_") and name.endswith(".tmp") for a in runs for name in a["ignored"])
    assert r["timeline"]["steps_redone"] == [[9], [9, 10, 11, 12], [], [13, 14, 15, 16], [17]]
    assert runs[-1]["steps"] == [17, 18]


@pytest.fixture(scope="module")
def hung_peer():
    return run_lesson(LESSON, nproc=2, args=["--fault", "hang@11:1", "--timeout-s", "3"], env=restarts(1),
                      timeout_s=90)


@pytest.mark.timeout(120)
def test_hung_peer_is_detected_and_the_job_restarts(hung_peer):
    run = hung_peer.check()
    r = run.results
    assert_claims(r, EXACT)
    a0, a1 = attempts(r)
    assert a0["fault"]["fault"] == "hang" and a0["peer_failure_t"] is not None  # rank 0's collective raised
    assert "[rank 0] a collective failed" in run.stderr and "Timed out" in run.stderr
    assert a1["resumed_from"] == 8 and r["claims"]["resumed_equals_uninterrupted"]["value"] == 0.0


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ft14")
    r = run_lesson(LESSON, nproc=4, args=["--no-random-draws", "--ckpt-dir", str(ckpt), "--save-sharded-at", "8"],
                   timeout_s=120).check().results
    return ckpt, r


@pytest.mark.timeout(150)
def test_four_rank_run_and_its_sharded_checkpoint(four_ranks):
    ckpt, r = four_ranks
    claims = assert_claims(r, EXACT - {"resume_without_rng_differs"})
    assert r["world_size"] == 4 and r["global_batch"] == 64 and r["sharded_bytes"] > 0
    # 4 ranks: gloo's ring sums in an order set by DDP's bucket layout: last-bit differences are allowed
    assert claims["resume_exact_equals_uninterrupted"]["value"] <= 1e-6
    assert (ckpt / "sharded_step_000008" / "COMPLETE.pt").is_file()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("keep", [False, True])
def test_four_ranks_to_two(four_ranks, keep):
    ckpt, _ = four_ranks
    args = ["--no-random-draws", "--resume-sharded", str(ckpt / "sharded_step_000008")]
    r = run_lesson(LESSON, nproc=2, args=args + (["--keep-global-batch"] if keep else []), timeout_s=90).check().results
    if keep:  # 2 micro-steps of 16 on 2 ranks: the 4-rank run's global batches, the same samples per step
        claims = assert_claims(r, {"params_equal_at_the_switch", "kept_global_batch_follows_old_world"})
        assert r["global_batch"] == 64 and claims["kept_global_batch_follows_old_world"]["value"] <= 1e-6
    else:  # per-rank batch kept: global batch 64 -> 32, another trajectory
        claims = assert_claims(r, {"params_equal_at_the_switch", "new_world_changes_trajectory"})
        assert r["global_batch"] == 32
    assert claims["params_equal_at_the_switch"]["value"] == 0.0


@pytest.mark.timeout(150)
def test_bad_input_fails_on_every_rank(four_ranks, tmp_path):
    ckpt, _ = four_ranks
    cases = [
        (["--resume", "--ckpt-dir", str(tmp_path)], "--resume: no complete checkpoint in"),
        (["--resume", "--ckpt-dir", str(ckpt)], "was written by 4 ranks and exact resume needs the same world size"),
        (["--resume-sharded", str(ckpt / "sharded_step_000008"), "--width", "32"], "checkpoint of another model"),
        (["--resume-sharded", str(ckpt / "sharded_step_000008"), "--keep-global-batch", "--batch-size", "24"],
         "cannot reshard keeping the global batch"),
        (["--crash-at-step", "40", "--crash-rank", "1"], "step 40 is beyond the run"),
    ]
    for args, message in cases:
        assert_fails_on_every_rank(run_lesson(LESSON, nproc=2, args=args, timeout_s=60), 2, message)
