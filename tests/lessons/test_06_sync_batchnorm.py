"""Lesson 05: the from-scratch SyncBatchNorm equals BatchNorm on the global batch; the lesson's claims hold.

    python -m pytest tests/test_05_sync_batchnorm.py -q
"""
from __future__ import annotations

import json
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from common.launch import run_lesson
from common.models import DigitsCNN
from common.counters import count_collectives
from common.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm, running_stats

TOL = 1e-5  # float32


def _spawn(world_size: int, tmp_path, device_type: str = "cpu") -> list[dict]:
    from tests._06_workers import proof_worker
    init_file = tmp_path / "store"
    ctx = mp.start_processes(proof_worker, args=(world_size, str(init_file), str(tmp_path), device_type),
                             nprocs=world_size, join=False, start_method="spawn")
    while not ctx.join(timeout=120):
        pass
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]


# ---------------------------------------------------------------- proofs on several ranks (gloo, CPU)

@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_matches_batchnorm_on_global_batch(world_size, tmp_path):
    per_rank = _spawn(world_size, tmp_path)
    for rank, cases in enumerate(per_rank):
        for name, d in cases.items():
            if name == "counts":
                continue
            for k in ("out", "dx", "dweight", "dbias", "running_mean", "running_var"):
                assert d[k] < TOL, f"world {world_size} rank {rank} case {name}: |{k} diff| = {d[k]:.2e}"
            assert d["num_batches_tracked"] == [2, 2], (name, d["num_batches_tracked"])
            assert d["running_stats_moved"] > 1e-3  # the statistics compared were really updated
    if world_size == 4:  # eval mode communicates nothing; training makes one all-reduce per layer each way
        for rank, cases in enumerate(per_rank):
            c = cases["counts"]
            assert c["train_forward"] == {"all_reduce": 2}, c
            assert c["train_backward"] == {"all_reduce": 2}, c
            assert c["eval_forward"] == {}, c
            assert not c["eval_changed_running_mean"]


@pytest.mark.timeout(240)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="nn.SyncBatchNorm runs on CUDA only")
def test_matches_torch_syncbatchnorm_on_cuda(tmp_path):
    for rank, cases in enumerate(_spawn(2, tmp_path, "cuda")):
        for k, v in cases["torch"].items():
            assert v < TOL, f"rank {rank}: |{k}| from-scratch vs nn.SyncBatchNorm = {v:.2e}"


# ---------------------------------------------------------------- one process

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- we compare type and message with BatchNorm's
        return type(e), str(e)
    return None


@pytest.mark.timeout(60)
def test_single_value_per_channel_raises_batchnorms_error_at_world_size_1():
    x = torch.randn(1, 3, 1, 1)
    expected = _error(lambda: nn.BatchNorm2d(3)(x))
    assert expected is not None and "Expected more than 1 value per channel" in expected[1]
    assert _error(lambda: convert_sync_batchnorm(nn.BatchNorm2d(3))(x)) == expected  # no process group
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:  # a real process group of one rank
        assert _error(lambda: convert_sync_batchnorm(nn.BatchNorm2d(3))(x)) == expected
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("x", [torch.randn(2, 4, 5, 5), torch.randn(2, 3), torch.randn(3)],
                         ids=["wrong_channels", "2d_input_to_2d_norm", "1d_input"])
def test_bad_input_gets_batchnorms_error(x):
    expected = _error(lambda: nn.BatchNorm2d(3)(x))
    assert expected is not None
    assert _error(lambda: convert_sync_batchnorm(nn.BatchNorm2d(3))(x)) == expected


def test_convert_swaps_children_in_place_and_shares_tensors():
    model = DigitsCNN()
    bn = model.features[1]
    out = convert_sync_batchnorm(model)
    assert out is model and isinstance(model.features[1], SyncBatchNorm)
    assert model.features[1].weight is bn.weight and model.features[1].running_mean is bn.running_mean
    assert set(model.state_dict()) == set(DigitsCNN().state_dict())  # checkpoints stay interchangeable


@settings(max_examples=25)
@given(b=st.integers(2, 6), c=st.integers(1, 4), hw=st.integers(1, 3), momentum=st.sampled_from([0.1, 0.5, None]),
       affine=st.booleans(), seed=st.integers(0, 2**16))
def test_one_process_equals_batchnorm(b, c, hw, momentum, affine, seed):
    """Without a process group the from-scratch module is BatchNorm (forward, backward, buffers, eval)."""
    g = torch.Generator().manual_seed(seed)
    ref = nn.BatchNorm2d(c, momentum=momentum, affine=affine)
    mine = convert_sync_batchnorm(nn.BatchNorm2d(c, momentum=momentum, affine=affine))
    for _ in range(2):
        x = torch.randn(b, c, hw, hw, generator=g) * 3 - 1
        gy = torch.randn(b, c, hw, hw, generator=g)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        for m, xi in zip((ref, mine), xs):
            (m(xi) * gy).sum().backward()
        torch.testing.assert_close(xs[1].grad, xs[0].grad, atol=TOL, rtol=TOL)
    torch.testing.assert_close(running_stats(mine), running_stats(ref), atol=TOL, rtol=TOL)
    if affine:
        torch.testing.assert_close(mine.weight.grad, ref.weight.grad, atol=TOL, rtol=TOL)
    ref.eval(), mine.eval()
    with count_collectives() as n:
        torch.testing.assert_close(mine(x), ref(x))
    assert n.total == 0


# ---------------------------------------------------------------- the lesson, launched as users do

@pytest.fixture(scope="module")
def lesson_run():
    args = ["--max-steps", "30", "--group-size", "2", "--device", "cpu"]
    return run_lesson("06_sync_batchnorm", nproc=4, args=args, timeout_s=240).check()


@pytest.mark.timeout(300)
def test_lesson_training_run(lesson_run):
    r = lesson_run.results
    assert r["world_size"] == 4 and r["sync_impl"] == "scratch" and r["device"] == "cpu"
    assert "SyncBatchNorm implementation: common.sync_batchnorm.SyncBatchNorm (from scratch)" in lesson_run.stdout
    assert r["convert"] == {"same_object": True, "before": ["BatchNorm2d", "BatchNorm2d"],
                            "after": ["SyncBatchNorm", "SyncBatchNorm"]}
    bn, sync = r["variants"]["batchnorm"], r["variants"]["syncbn"]
    for v in (bn, sync):
        assert v["steps"] == 30 and v["max_param_diff"] == 0.0  # DDP keeps the parameters identical either way
    # BatchNorm: each rank's running statistics drift apart; SyncBatchNorm (groups {0,1},{2,3}): identical within
    # a group, different between groups.
    assert bn["spread_running_mean"] > 1e-3 and bn["spread_running_var"] > 1e-3
    assert sync["spread_within_groups"] == 0.0
    assert sync["spread_across_groups"] > 1e-3
    assert r["group_of_rank"] == [0, 0, 1, 1]
    rm = sync["first_layer_running_mean"]
    assert rm[0] == rm[1] and rm[2] == rm[3] and rm[0] != rm[2]
    # Collectives per step (deterministic): BatchNorm none, SyncBatchNorm one per layer in forward and backward.
    assert bn["collectives_per_step"] == {"forward": 0, "backward": 0, "ddp_buckets": 1}
    assert sync["collectives_per_step"] == {"forward": 2, "backward": 2, "ddp_buckets": 1}
    # SyncBN's eval-mode models are identical within a group, so their test accuracies are too. (BatchNorm's
    # per-rank accuracies may or may not differ after 30 steps; its statistics' spread, above, is the evidence.)
    assert len(set(sync["test_accuracy_per_rank"][:2])) == 1 and len(set(sync["test_accuracy_per_rank"][2:])) == 1


@pytest.mark.timeout(120)
def test_lesson_whole_world_syncbn_identical_on_all_ranks():
    """Default grouping (the whole world), 2 ranks: the SyncBatchNorm running statistics are bit-identical."""
    args = ["--max-steps", "10", "--batch-size", "2", "--device", "cpu"]
    run = run_lesson("06_sync_batchnorm", nproc=2, args=args, timeout_s=120).check()
    sync, bn = run.results["variants"]["syncbn"], run.results["variants"]["batchnorm"]
    assert sync["spread_running_mean"] == 0.0 and sync["spread_running_var"] == 0.0
    assert len(set(sync["test_accuracy_per_rank"])) == 1
    assert bn["spread_running_mean"] > 1e-3


@pytest.mark.timeout(90)
def test_lesson_bad_input():
    run = run_lesson("06_sync_batchnorm", nproc=2, args=["--group-size", "3"], timeout_s=90)
    assert run.returncode != 0
    for rank in (0, 1):
        assert f"[rank {rank}] error: --group-size 3 must be 0 or divide the world size 2" in run.stderr
    run = run_lesson("06_sync_batchnorm", nproc=None, args=["--sync-impl", "torch", "--device", "cpu"],
                     timeout_s=60)
    assert run.returncode == 2 and "error: --sync-impl torch: nn.SyncBatchNorm runs on GPUs only" in run.stderr
