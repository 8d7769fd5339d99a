"""Lesson 07's pieces in one process (no torchrun): batch arithmetic, the variants against one global step,
and the micro-batch stream the training loop and its replay share."""

from __future__ import annotations

import importlib
from contextlib import nullcontext

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from common.data_parallel.accumulation import grad_accum_steps_for, uneven_sizes
from common.data_parallel.micro_batches import micro_batch_stream, no_sync_unless
from common.harness.env import LessonError
from common.measure.differences import max_abs_diff_all
from common.models import ResidualMLP

lesson = importlib.import_module("lessons.07_gradient_accumulation")


@given(g=st.integers(-4, 200), m=st.integers(-2, 16), w=st.integers(1, 8))
def test_grad_accum_steps_arithmetic(g, m, w):
    try:
        k = grad_accum_steps_for(g, m, w)
    except LessonError as e:
        assert g < 1 or m < 1 or g % (m * w), str(e)
        assert "\n" not in str(e)
    else:
        assert k >= 1 and k * m * w == g


@given(n=st.integers(1, 64), k=st.integers(1, 16))
def test_uneven_sizes(n, k):
    if n < k:
        return
    sizes = uneven_sizes(n, k)
    assert len(sizes) == k and sum(sizes) == n and min(sizes) >= 1
    assert k == 1 or n == k or len(set(sizes)) > 1


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = ResidualMLP(width=32, depth=2)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(10, (16,))
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()  # the mean over all 16 samples
    ref = [p.grad.clone() for p in model.parameters()]
    return model, x, y, ref


def _grads(model, variant, batches):
    model.zero_grad(set_to_none=True)
    variant(model, batches)
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "name, right",
    [
        ("accumulate", True),
        ("accumulate_always_sync", True),
        ("accumulate_no_divide", False),
        ("accumulate_running_divide", False),
    ],
)
def test_variants_in_one_process(setup, name, right):
    model, x, y, ref = setup
    even = list(zip(x.split(4), y.split(4)))  # k = 4 micro-batches of 4
    diff = max_abs_diff_all(_grads(model, getattr(lesson, name), even), ref)
    assert (diff < 1e-6) if right else (diff > 1e-3), diff


def test_uneven_micro_batches_need_sample_weights(setup):
    model, x, y, ref = setup
    sizes = uneven_sizes(16, 4)  # [13, 1, 1, 1]
    uneven = list(zip(x.split(sizes), y.split(sizes)))
    assert max_abs_diff_all(_grads(model, lesson.accumulate_sample_weighted, uneven), ref) < 1e-6
    assert max_abs_diff_all(_grads(model, lesson.accumulate, uneven), ref) > 1e-3


def test_no_sync_unless_is_a_no_op_without_ddp(setup):
    assert isinstance(no_sync_unless(setup[0], last=False), nullcontext)


def test_micro_batch_streams_cover_each_epoch_once_across_ranks():
    data = TensorDataset(torch.arange(24.0).unsqueeze(1), torch.zeros(24, dtype=torch.long))
    streams = [micro_batch_stream(data, 3, 2, r, seed=0) for r in range(2)]
    epoch0 = [
        next(s)[0] for s in streams for _ in range(4)
    ]  # 2 ranks x 4 micro-batches of 3 = 24 samples
    assert sorted(torch.cat(epoch0).flatten().tolist()) == list(range(24))
    epoch1 = [next(streams[0])[0] for _ in range(4)]  # set_epoch(1): a new order on rank 0
    assert torch.cat(epoch1).flatten().tolist() != torch.cat(epoch0[:4]).flatten().tolist()


@pytest.mark.parametrize(
    "argv", [["--grad-accum-steps", "1"], ["--global-batch", "2"], ["--steps", "10"]]
)
def test_parse_args_refuses_what_would_make_a_claim_fail(argv, monkeypatch):
    """k = 1: every wrong variant equals the right one; --steps < 20: one loss report, nothing can fall."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LessonError, match="need grad_accum_steps >= 2"):
        lesson.parse_args(argv)
