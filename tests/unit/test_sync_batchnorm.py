"""Lesson 06's building blocks without torchrun: the from-scratch SyncBatchNorm in one process, its instruments
(common.data_parallel.bn_stats), the one-process replay, and DDP's buffer-broadcast rule in a spawned world of 2 (a few seconds).

    python -m pytest tests/unit/test_sync_batchnorm.py -q

The proofs on 2, 3 and 4 ranks (against BatchNorm on the concatenated global batch) and the lesson's launches
live in tests/lessons/test_06_sync_batchnorm.py.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from common.data import digits_split
from common.data_parallel.bn_stats import local_accuracy, replay, running_stats, spread
from common.data_parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from common.measure.counters import count_collectives
from common.models import DigitsCNN
from tests._workers import run_world

TOL = 1e-5  # float32


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
    assert (
        _error(lambda: convert_sync_batchnorm(nn.BatchNorm2d(3))(x)) == expected
    )  # no process group
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=30),
    )
    try:  # a real process group of one rank
        assert _error(lambda: convert_sync_batchnorm(nn.BatchNorm2d(3))(x)) == expected
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "x",
    [torch.randn(2, 4, 5, 5), torch.randn(2, 3), torch.randn(3)],
    ids=["wrong_channels", "2d_input_to_2d_norm", "1d_input"],
)
def test_bad_input_gets_batchnorms_error(x):
    expected = _error(lambda: nn.BatchNorm2d(3)(x))
    assert expected is not None
    assert _error(lambda: convert_sync_batchnorm(nn.BatchNorm2d(3))(x)) == expected


@pytest.mark.timeout(30)
def test_convert_swaps_children_in_place_and_shares_tensors():
    model = DigitsCNN()
    assert [
        type(m).__name__ for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ] == ["BatchNorm2d", "BatchNorm2d"]
    bn = model.features[1]
    out = convert_sync_batchnorm(model)
    assert out is model and isinstance(model.features[1], SyncBatchNorm)
    assert (
        model.features[1].weight is bn.weight and model.features[1].running_mean is bn.running_mean
    )
    assert set(model.state_dict()) == set(
        DigitsCNN().state_dict()
    )  # checkpoints stay interchangeable


@pytest.mark.parametrize("frozen", ["model", "bn_only"])
def test_convert_keeps_each_modules_train_or_eval_mode_as_torch_does(frozen):
    # fine-tuning often converts a model whose BatchNorm layers were put in eval mode (frozen statistics)
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Sequential(nn.BatchNorm2d(3))
        )
        if frozen == "model":
            model.eval()
        else:
            model[1].eval()
        return model

    ours, theirs = convert_sync_batchnorm(build()), nn.SyncBatchNorm.convert_sync_batchnorm(build())
    modes = [m.training for m in ours.modules()]
    assert modes == [m.training for m in theirs.modules()]
    assert modes[2] is False and isinstance(
        ours[1], SyncBatchNorm
    )  # the converted layer stays in eval mode
    assert modes[-1] is (frozen == "bn_only")


@pytest.mark.timeout(60)
@settings(max_examples=25)
@given(
    b=st.integers(2, 6),
    c=st.integers(1, 4),
    hw=st.integers(1, 3),
    momentum=st.sampled_from([0.1, 0.5, None]),
    affine=st.booleans(),
    seed=st.integers(0, 2**16),
)
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


def test_spread_is_max_minus_min_per_kind():
    # 2 ranks, one layer of 2 channels: [mean_0, mean_1, var_0, var_1]
    stats = torch.tensor([[0.0, 1.0, 5.0, 5.0], [0.5, 1.0, 5.0, 7.0]], dtype=torch.float64)
    assert spread(stats, [2]) == (0.5, 2.0)
    assert spread(stats[:1], [2]) == (0.0, 0.0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("start_in_train", [True, False])
def test_local_accuracy_restores_the_mode(start_in_train):
    _, test_set = digits_split()
    model = DigitsCNN().train(start_in_train)
    acc = local_accuracy(model, test_set)
    assert 0.0 <= acc <= 1.0 and model.training is start_in_train


@pytest.mark.timeout(60)
def test_replay_of_one_rank_is_the_same_for_both_variants():
    """One rank: per-rank statistics are the global batch's, so both replays train the same model."""
    train_set, _ = digits_split()
    a, b = (replay(v, train_set, 4, 1, 10, 0.02, seed=0) for v in ("syncbn", "batchnorm"))
    for p, q in zip([*a.parameters(), running_stats(a)], [*b.parameters(), running_stats(b)]):
        torch.testing.assert_close(p, q)


@pytest.mark.timeout(60)
def test_replay_batchnorm_keeps_rank0_statistics_only():
    """2 ranks replayed: BatchNorm's running statistics come from rank 0's micro-batches, SyncBatchNorm's from the
    concatenation, so they differ; the parameters (gradient of the same global loss) differ too, but little."""
    train_set, _ = digits_split()
    a, b = (replay(v, train_set, 4, 2, 5, 0.02, seed=0) for v in ("syncbn", "batchnorm"))
    assert (running_stats(a) - running_stats(b)).abs().max() > 1e-4
    assert all(
        m.momentum == 0.1 for m in b.modules() if isinstance(m, nn.BatchNorm2d)
    )  # left as found


@pytest.mark.timeout(90)
def test_ddp_buffer_broadcast_rule_and_global_batch_tracker(tmp_path):
    """torch 2.13: a forward broadcasts rank 0's buffers only if the previous forward synced gradients."""
    from tests._06_workers import buffer_broadcast_rule

    for r in run_world(buffer_broadcast_rule, 2, tmp_path, timeout_s=80):
        assert r["counts"] == {
            "3 training steps": 3,
            "3 forwards under no_grad": 1,
            "the training step after them": 0,
            "2 optimizer steps of 3 micro-steps, no_sync on 2": 2,
            "1 no_sync micro-step, then 1 synced": 1,
            "forward_sync_buffers=False, 3 training steps": 0,
        }, r["counts"]
        assert r["warned"]  # broadcast_buffers= is deprecated with a FutureWarning
        assert (
            r["off_spread"] > 1e-3
        )  # forward_sync_buffers=False: each rank kept its own statistics
        assert r["tracker_vs_global"] < TOL and r["tracker_moved"] > 1e-3
        assert r["output_changed"] == 0.0 and r["hooks_left"] == 0
