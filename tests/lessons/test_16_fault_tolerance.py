"""Lesson 16: fault tolerance, under real torchrun restarts.

Each configuration is launched once (module fixtures). `PET_MAX_RESTARTS` is torchrun's environment form of
--max-restarts (every torchrun option reads PET_<NAME>), so `run_lesson` launches exactly the docstring's command.
The checkpoint file format, the sampler and the timeline are unit-tested in tests/unit/test_train_state.py.
"""

from __future__ import annotations

import copy
import importlib
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common.run.launch import run_lesson, torchrun_command
from common.run.processes import run_command
from tests._lessons import assert_claims, assert_fails_on_every_rank, assert_lines_fit
from tests._workers import free_port

LESSON = "16_fault_tolerance"
EQUAL = (
    "resumed_equals_uninterrupted",
    "loss_curve_equals_uninterrupted",
    "resume_exact_equals_uninterrupted",
)
WRONG = (
    "resume_at_epoch_start_differs",
    "resume_without_optimizer_differs",
    "resume_without_rng_differs",
)
EXACT = {*EQUAL, *WRONG}


def assert_bounds(claims: dict, world_size: int, lr: float = 0.01) -> None:
    """The bounds the lesson states, pinned: equal within 0.0 on <= 2 ranks (1e-6 above: the ring's sum order),
    and a wrong resume at least 1e-3 * lr away (AdamW moves parameters by about lr per step)."""
    for name in EQUAL:
        assert (claims[name]["relation"], claims[name]["bound"]) == (
            "<=",
            0.0 if world_size <= 2 else 1e-6,
        ), name
    for name in set(WRONG) & set(claims):
        assert (claims[name]["relation"], claims[name]["bound"]) == (
            ">=",
            pytest.approx(1e-3 * lr),
        ), name


def restarts(n: int) -> dict:
    return {"PET_MAX_RESTARTS": str(n)}


def attempts(r: dict) -> list[dict]:
    return r["timeline"]["attempts"]


@pytest.fixture(scope="module")
def crash_at_7():
    """The docstring's command: rank 1 os._exit()s in step 7, the first step of epoch 1 (6 steps per epoch)."""
    args = ["--crash-at-step", "7", "--crash-rank", "1"]
    run = run_lesson(LESSON, nproc=2, args=args, env=restarts(2), timeout_s=180).check()
    assert_lines_fit(run)
    return run.results


@pytest.fixture(scope="module")
def five_faults():
    """One fault per attempt: mid-epoch crash, killed writer (mid-write), crash resuming at an epoch boundary,
    killed writer (before the rename), crash in the last step."""
    faults = ["exit@10:1", "mid-write@12", "exit@13:0", "before-rename@16", "exit@18:1"]
    return (
        run_lesson(LESSON, nproc=2, args=["--fault", *faults], env=restarts(5), timeout_s=300)
        .check()
        .results
    )


@pytest.mark.timeout(240)
def test_crash_restart_equals_uninterrupted_run(crash_at_7):
    r = crash_at_7
    claims = assert_claims(r, EXACT)
    assert_bounds(claims, 2)
    for name in EQUAL:
        assert claims[name]["value"] == 0.0, name  # bit for bit on 2 ranks
    a0, a1 = attempts(r)
    assert r["attempt"] == 1 and r["attempts"] == 2
    assert a0["fault"]["fault"] == "exit" and (a0["fault"]["step"], a0["fault"]["rank"]) == (7, 1)
    assert a0["steps"] == [1, 2, 3, 4, 5, 6] and [s for s, _ in a0["saves"]] == [4]
    assert a1["resumed_from"] == 4 and a1["steps"] == list(
        range(5, 19)
    )  # resumed mid-epoch 0 (4 of 6 steps)
    assert r["timeline"]["steps_redone"] == [[5, 6]]
    assert r["resume_1"] == {"from": 4, "ignored": 0, "redone": [5, 6]}


@pytest.mark.timeout(60)
def test_a_sampler_that_never_rolls_over_fails_instead_of_looping(tmp_path, monkeypatch):
    """A sampler whose epoch never ends has no batch left after its first epoch: the training loop raises
    there, rather than starting empty epochs forever (the timeout above is only a safety net). One process."""
    from common.data import digits_split
    from common.harness.env import DistInfo
    from common.harness.results import Report

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    m = importlib.import_module(f"lessons.{LESSON}")
    args, info = m.parse_args(["--steps", "20", "--ckpt-dir", str(tmp_path)]), DistInfo()
    train_set = torch.utils.data.Subset(digits_split()[0], range(args.train_samples))
    T = m.build(args, info, Report(info), train_set)
    steps_per_epoch = len(T.sampler) // args.global_batch  # 192 / 16 = 12 in one process

    def never_rolls_over(global_samples: int) -> None:  # noqa: E306
        T.sampler.seen += global_samples

    monkeypatch.setattr(T.sampler, "advance", never_rolls_over)
    with pytest.raises(
        AssertionError, match=f"step {steps_per_epoch}: the sampler has no batch left"
    ):
        m.train(T, 0, args.steps)


@pytest.mark.timeout(120)
def test_each_resume_variant_leaves_the_snapshot_as_it_was(tmp_path, monkeypatch):
    """AdamW's load_state_dict keeps the tensors it is given and updates them in place: a snapshot shared by
    the variants reached the next one trained on (its step count went 12 -> 42). One process, in pytest."""
    from common.checkpoint.train_state import roundtrip
    from common.data import digits_split
    from common.harness.env import DistInfo
    from common.harness.results import Report

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    m = importlib.import_module(f"lessons.{LESSON}")
    args, info = m.parse_args(["--steps", "6", "--ckpt-dir", str(tmp_path)]), DistInfo()
    train_set = torch.utils.data.Subset(digits_split()[0], range(args.train_samples))
    R = m.build(args, info, Report(info), train_set)
    m.train(R, 0, 4)
    snapshot = roundtrip(m.capture(R, 4))
    before = copy.deepcopy(snapshot)
    reference = [p.detach() for p in R.raw.parameters()]
    variants = [
        m.resume_exact,
        m.resume_at_epoch_start,
        m.resume_without_optimizer,
        m.resume_without_rng,
    ]
    m.resume_variants(R, train_set, snapshot, reference, variants)
    flat = lambda state: {k: v for k, v in torch.utils._pytree.tree_flatten_with_path(state)[0]}  # noqa: E731
    assert flat(snapshot).keys() == flat(before).keys()
    for key, value in flat(before).items():
        now = flat(snapshot)[key]
        assert torch.equal(now, value) if isinstance(value, torch.Tensor) else now == value, key
    assert before["optimizer"]["state"][0]["step"].item() == 4.0


@pytest.mark.timeout(400)
def test_every_fault_resumes_from_the_last_complete_checkpoint(five_faults):
    r = five_faults
    assert_claims(r, EXACT)
    assert r["claims"]["resumed_equals_uninterrupted"]["value"] == 0.0
    runs = attempts(r)
    assert [a["fault"]["fault"] for a in runs[:5]] == [
        "exit",
        "mid-write",
        "exit",
        "before-rename",
        "exit",
    ]
    # exit@10 (mid-epoch 1) -> 8; the save at 12 killed mid-write -> 8 again, its temp file ignored;
    # exit@13 -> 12 (= the end of epoch 1: resume at an epoch boundary); the save at 16 killed before its rename
    # -> 12, its temp file ignored; exit@18 (the last step) -> 16.
    assert [a["resumed_from"] for a in runs[1:]] == [8, 8, 12, 12, 16]
    assert [len(a["ignored"]) for a in runs[1:]] == [0, 1, 0, 1, 0]
    assert all(
        name.startswith(".step_") and name.endswith(".tmp") for a in runs for name in a["ignored"]
    )
    assert r["timeline"]["steps_redone"] == [[9], [9, 10, 11, 12], [], [13, 14, 15, 16], [17]]
    assert runs[-1]["steps"] == [17, 18]


@pytest.fixture(scope="module")
def hung_peer():
    return run_lesson(
        LESSON,
        nproc=2,
        args=["--fault", "hang@11:1", "--timeout-s", "3"],
        env=restarts(1),
        timeout_s=180,
    )


@pytest.mark.timeout(240)
def test_hung_peer_is_detected_and_the_job_restarts(hung_peer):
    run = hung_peer.check()
    r = run.results
    assert_claims(r, EXACT)
    a0, a1 = attempts(r)
    assert (
        a0["fault"]["fault"] == "hang" and a0["peer_failure_t"] is not None
    )  # rank 0's collective raised
    assert "[rank 0] a collective failed" in run.stderr and "Timed out" in run.stderr
    assert a1["resumed_from"] == 8 and r["claims"]["resumed_equals_uninterrupted"]["value"] == 0.0


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ft16")
    args = ["--no-random-draws", "--ckpt-dir", str(ckpt)]
    run = run_lesson(LESSON, nproc=4, args=args, timeout_s=240).check()
    assert_lines_fit(run)
    return ckpt, run.results


@pytest.mark.timeout(300)
def test_four_rank_run(four_ranks):
    ckpt, r = four_ranks
    claims = assert_claims(r, EXACT - {"resume_without_rng_differs"})
    assert r["world_size"] == 4 and r["global_batch"] == 64
    # 4 ranks: gloo's ring sums in an order set by DDP's bucket layout: last-bit differences are allowed
    assert_bounds(claims, 4)


@pytest.mark.timeout(300)
def test_bad_input_fails_on_every_rank(four_ranks, tmp_path):
    ckpt, _ = four_ranks
    cases = [
        (["--resume", "--ckpt-dir", str(tmp_path)], "--resume: no complete checkpoint in"),
        (
            ["--resume", "--ckpt-dir", str(ckpt)],
            "was written by 4 ranks and exact resume needs the same world size",
        ),
        (["--crash-at-step", "40", "--crash-rank", "1"], "step 40 is beyond the run"),
    ]
    for args, message in cases:
        assert_fails_on_every_rank(
            run_lesson(LESSON, nproc=2, args=args, timeout_s=120), 2, message
        )


@pytest.fixture(scope="module")
def killed_first_save_then_raise(tmp_path_factory):
    """The first save killed mid-write (nothing to resume: start again), then rank 1 raises in step 7."""
    ckpt = tmp_path_factory.mktemp("ft14_first")
    run = run_lesson(
        LESSON,
        nproc=2,
        args=["--fault", "mid-write@4", "raise@7:1", "--ckpt-dir", str(ckpt)],
        env=restarts(2),
        timeout_s=300,
    )
    return ckpt, run.check()


@pytest.mark.timeout(400)
def test_a_killed_first_save_starts_from_scratch_and_leaves_no_temp_file(
    killed_first_save_then_raise,
):
    ckpt, run = killed_first_save_then_raise
    r = run.results
    assert_bounds(assert_claims(r, EXACT), 2)
    assert r["resume_1"] == {"from": None, "ignored": 1, "redone": [1, 2, 3, 4]}
    assert (
        "attempt 1 found no complete checkpoint and started from scratch (removed 1 leftover"
        in run.stdout
    )
    assert r["resume_2"]["from"] == 4 and not list(ckpt.glob(".step_*.tmp"))


@pytest.mark.timeout(400)
def test_record_writes_the_error_file_of_the_rank_that_raised(killed_first_save_then_raise):
    _, run = killed_first_save_then_raise
    assert run.results["error_file_1"] == {
        "rank": 1,
        "message": "InjectedFault: injected fault in step 7 on rank 1",
    }
    assert (
        "[rank 0] a collective failed" in run.stderr
    )  # rank 0 only exited because its peer was gone


def two_nodes(tmp_path, fault: list[str], timeout_s: float = 240) -> dict:
    """Two torchrun agents on loopback (--nnodes=2, one process each, c10d), the same command on each."""
    results = tmp_path / "results.json"
    args = ["--fault", *fault, "--ckpt-dir", str(tmp_path / "ckpt"), "--results", str(results)]
    cmd = torchrun_command(LESSON, 1, args, nnodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}")
    with ThreadPoolExecutor(
        2
    ) as pool:  # each node is killed with its processes if it outlives timeout_s
        nodes = list(
            pool.map(lambda _: run_command(cmd, timeout_s=timeout_s, env=restarts(2)), range(2))
        )
    assert [n.returncode for n in nodes] == [0, 0], [n.stderr[-3000:] for n in nodes]
    return json.loads(results.read_text())


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "fault", [["exit@7:1"], ["hang@7:1", "--timeout-s", "3"]], ids=["crash", "hang"]
)
def test_two_nodes_restart_together_and_equal_the_uninterrupted_run(tmp_path, fault):
    """pytorch/pytorch#108158: the node whose workers did not fail restarts without counting; the attempt every
    node agrees on (common/harness/rendezvous.py) keeps both in one process group and one fault schedule."""
    r = two_nodes(tmp_path, fault)
    claims = assert_claims(r, EXACT)
    assert all(claims[name]["value"] == 0.0 for name in EQUAL)
    a0, a1 = attempts(r)
    assert (
        r["attempt"] == 1
        and a0["fault"]["fault"] == fault[0].split("@")[0]
        and a0["fault"]["rank"] == 1
    )
    assert a1["resumed_from"] == 4 and a1["steps"] == list(range(5, 19))
