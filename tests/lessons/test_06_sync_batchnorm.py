"""Lesson 06: the from-scratch SyncBatchNorm equals BatchNorm on the global batch (2, 3, 4 ranks); the lesson's
claims hold when launched as users launch it (4 processes with groups, 2 processes, plain python, bad input).

    python -m pytest tests/lessons/test_06_sync_batchnorm.py -q

The one-process checks and DDP's buffer-broadcast rule are in tests/unit/test_sync_batchnorm.py.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.multiprocessing as mp

from common.run.launch import run_lesson
from tests._lessons import assert_claims, assert_fails_on_every_rank, assert_lines_fit

TOL = 1e-5  # float32


def _spawn(
    world_size: int, tmp_path, device_type: str = "cpu", timeout_s: float = 150
) -> list[dict]:
    from tests._06_workers import proof_worker
    from tests._workers import START_METHOD  # forkserver: torch imported once, not once per rank

    init_file = tmp_path / "store"
    ctx = mp.start_processes(
        proof_worker,
        args=(world_size, str(init_file), str(tmp_path), device_type),
        nprocs=world_size,
        join=False,
        start_method=START_METHOD,
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"world of {world_size} did not finish in {timeout_s} s")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]


# ---------------------------------------------------------------- proofs on several ranks (gloo, CPU)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_matches_batchnorm_on_global_batch(world_size, tmp_path):
    per_rank = _spawn(world_size, tmp_path)
    for rank, cases in enumerate(per_rank):
        for name, d in cases.items():
            if name == "counts":
                continue
            for k in ("out", "dx", "dweight", "dbias", "running_mean", "running_var"):
                assert d[k] < TOL, (
                    f"world {world_size} rank {rank} case {name}: |{k} diff| = {d[k]:.2e}"
                )
            assert d["num_batches_tracked"] == [2, 2], (name, d["num_batches_tracked"])
            assert d["running_stats_moved"] > 1e-3  # the statistics compared were really updated
    if (
        world_size == 4
    ):  # eval mode communicates nothing; training makes one all-reduce per layer each way
        for cases in per_rank:
            c = cases["counts"]
            assert c["train_forward"] == {"all_reduce": 2}, c
            assert c["train_backward"] == {"all_reduce": 2}, c
            assert c["eval_forward"] == {}, c
            assert not c["eval_changed_running_mean"]


@pytest.mark.timeout(480)
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="nn.SyncBatchNorm needs an accelerator (CUDA here)"
)
def test_matches_torch_syncbatchnorm_on_cuda(tmp_path):
    for rank, cases in enumerate(_spawn(2, tmp_path, "cuda")):
        for k, v in cases["torch"].items():
            assert v < TOL, f"rank {rank}: |{k}| from-scratch vs nn.SyncBatchNorm = {v:.2e}"


# ---------------------------------------------------------------- the lesson, launched as users do


@pytest.fixture(scope="module")
def four_ranks_two_groups():
    args = ["--max-steps", "30", "--group-size", "2", "--device", "cpu"]
    return run_lesson("06_sync_batchnorm", nproc=4, args=args, timeout_s=480).check()


@pytest.fixture(scope="module")
def two_ranks():
    args = ["--max-steps", "10", "--batch-size", "2", "--device", "cpu"]
    return run_lesson("06_sync_batchnorm", nproc=2, args=args, timeout_s=240).check()


BUFFER_RULE = {
    "broadcasts_per_training_step",
    "broadcasts_per_evaluation",
    "broadcasts_first_step_after_eval",
    "broadcasts_per_accumulation_step",
    "construction_sends_buffers",
    "default_rank0_same_as_without_sync",
    "default_rank0_differs_from_global_batch",
    "default_stats_equal_after_eval",
    "default_accuracy_identical",
}
PER_VARIANT = {
    f"{v}_{c}"
    for v in ("syncbn", "batchnorm")
    for c in (
        "forward_collectives",
        "backward_collectives",
        "ddp_bucket_allreduces",
        "params_identical_across_ranks",
        "no_forward_broadcasts",
    )
}


@pytest.mark.timeout(600)
def test_lesson_four_ranks_in_two_groups(four_ranks_two_groups):
    run, r = four_ranks_two_groups, four_ranks_two_groups.results
    assert_lines_fit(run)
    claims = assert_claims(
        r,
        PER_VARIANT
        | BUFFER_RULE
        | {
            "convert_swaps_in_place",
            "syncbn_stats_identical_within_group",
            "syncbn_accuracy_identical_within_group",
            "syncbn_stats_differ_between_groups",
            "batchnorm_running_mean_drifts",
            "batchnorm_running_var_drifts",
        },
    )
    assert r["setup"] == [4, 4, 30] and r["sync_impl"] == "scratch" and "(gloo, cpu)" in run.stdout
    assert (
        "SyncBatchNorm implementation: common.data_parallel.sync_batchnorm.SyncBatchNorm (from scratch)"
        in run.stdout
    )
    assert claims["convert_swaps_in_place"]["value"] == 2
    bn, sync = r["variants"]["batchnorm"], r["variants"]["syncbn"]
    for v in (bn, sync):
        assert (
            v["steps"] == 30 and v["max_param_diff"] == 0.0
        )  # DDP keeps the parameters identical either way
    # BatchNorm: each rank's running statistics drift apart; SyncBatchNorm (groups {0,1},{2,3}): identical within
    # a group, different between groups. The groups come from the Grid's bn dimension.
    assert bn["spread_running_mean"] > 1e-3 and bn["spread_running_var"] > 1e-3
    assert sync["spread_within_groups"] == 0.0 and sync["spread_across_groups"] > 1e-3
    assert r["bn_groups"] == [[0, 1], [2, 3]] and r["group_of_rank"] == [0, 0, 1, 1]
    rm = sync["first_layer_running_mean"]
    assert rm[0] == rm[1] and rm[2] == rm[3] and rm[0] != rm[2]
    # Collectives per step (deterministic): BatchNorm none, SyncBatchNorm one per layer in forward and backward.
    assert bn["collectives_per_step"] == {"forward": 0, "backward": 0, "ddp_buckets": 1}
    assert sync["collectives_per_step"] == {"forward": 2, "backward": 2, "ddp_buckets": 1}
    acc = sync["test_accuracy_per_rank"]
    assert len(set(acc[:2])) == 1 and len(set(acc[2:])) == 1
    # DDP's buffer broadcast, counted: 30 training steps -> 30; the 400 bytes are 2 x (running mean + var + count)
    assert (
        claims["broadcasts_per_training_step"]["value"] == 1
        and "30 buffer broadcasts" in run.stdout
    )
    assert claims["construction_sends_buffers"]["value"] == 4 * (16 + 16 + 32 + 32) + 2 * 8
    assert (
        "replay_equals_ddp_syncbn" not in claims
    )  # groups of 2: the replay stands for one group of all ranks


@pytest.mark.timeout(300)
def test_lesson_whole_world_syncbn_identical_on_all_ranks(two_ranks):
    """Default grouping (the whole world), 2 ranks: the SyncBatchNorm running statistics are bit-identical."""
    r = two_ranks.results
    assert_lines_fit(two_ranks)
    claims = assert_claims(
        r,
        PER_VARIANT
        | BUFFER_RULE
        | {
            "syncbn_stats_identical_within_group",
            "syncbn_accuracy_identical_within_group",
            "batchnorm_running_mean_drifts",
            "replay_equals_ddp_syncbn",
            "replay_equals_ddp_batchnorm",
        },
    )
    sync, bn = r["variants"]["syncbn"], r["variants"]["batchnorm"]
    assert sync["spread_running_mean"] == 0.0 and sync["spread_running_var"] == 0.0
    assert len(set(sync["test_accuracy_per_rank"])) == 1
    assert bn["spread_running_mean"] > 1e-3
    assert r["bn_groups"] == [[0, 1]] and "syncbn_stats_differ_between_groups" not in claims


@pytest.mark.timeout(300)
def test_lesson_defaults_four_ranks():
    """The notebook's command (4 ranks, the defaults, CPU): one launch serves both. Every claim holds, the
    one-process replay included, and every printed line fits."""
    run = run_lesson("06_sync_batchnorm", nproc=4, args=["--device", "cpu"], timeout_s=240).check()
    claims = assert_claims(
        run.results,
        PER_VARIANT | BUFFER_RULE | {"replay_equals_ddp_syncbn", "convert_swaps_in_place"},
    )
    assert run.results["setup"] == [4, 4, 60] and claims["syncbn_forward_collectives"]["value"] == 2
    assert_lines_fit(run)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nproc", [None, 1], ids=["python", "torchrun_1"])
def test_lesson_one_process(nproc):
    """Plain python (no process group) and torchrun with 1 process (DDP over a world of one): SyncBatchNorm is
    BatchNorm, the replay matches, DDP makes its one bucket all-reduce only when it exists."""
    run = run_lesson(
        "06_sync_batchnorm", nproc=nproc, args=["--max-steps", "20"], timeout_s=180
    ).check()
    claims = assert_claims(
        run.results, PER_VARIANT | {"replay_equals_ddp_syncbn", "replay_equals_ddp_batchnorm"}
    )
    assert_lines_fit(run)
    assert claims["syncbn_forward_collectives"]["value"] == 0  # a group of one communicates nothing
    assert claims["syncbn_ddp_bucket_allreduces"]["value"] == (0 if nproc is None else 1)
    if nproc:  # DDP exists: the buffer-broadcast rule holds in a world of one too
        assert claims["broadcasts_per_evaluation"]["value"] == 1
    assert run.results["syncbn_test_accuracy"] == run.results["batchnorm_test_accuracy"]


@pytest.mark.timeout(240)
def test_lesson_bad_input():
    run = run_lesson("06_sync_batchnorm", nproc=2, args=["--group-size", "3"], timeout_s=180)
    assert_fails_on_every_rank(run, 2, "--group-size 3 must be 0 or divide the world size 2")
    run = run_lesson(
        "06_sync_batchnorm",
        nproc=None,
        args=["--sync-impl", "torch", "--device", "cpu"],
        timeout_s=120,
    )
    assert (
        run.returncode == 2
        and "error: --sync-impl torch: nn.SyncBatchNorm runs on accelerators only" in run.stderr
    )
