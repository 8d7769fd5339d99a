"""Pipeline schedules and the hand-written executor (common/pipeline/schedules.py, common/pipeline/executor.py):
pure functions, one-stage runs in this process, and one 2-rank world showing torch 2.13's uneven-micro-batch failure.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from common.models import mlp
from common.pipeline.executor import check_order, run_pipeline_step
from common.pipeline.schedules import (
    default_split_points,
    gpipe_order,
    interleaved_1f1b_order,
    interleaved_stage_indices,
    microbatch_sizes,
    one_f_one_b_order,
    peak_live_in_order,
    schedule_limit,
    schedule_order,
    split_model,
    theory_bubble,
    theory_speedup,
)
from tests._workers import run_world

TOL = 1e-5


def test_microbatch_sizes():
    assert microbatch_sizes(10, 4) == [3, 3, 3, 1]
    assert microbatch_sizes(8, 4) == [2, 2, 2, 2]
    assert [t.shape[0] for t in torch.arange(10).chunk(4)] == microbatch_sizes(
        10, 4
    )  # torch.chunk's cut
    for n, m in [(3, 4), (10, 6), (5, 0)]:
        with pytest.raises(ValueError):
            microbatch_sizes(n, m)


def test_split_model():
    model = mlp([4, 8, 8, 8, 2])  # 7 modules
    stages = split_model(model, default_split_points(model, 2))
    assert sum(len(s) for s in stages) == len(model)
    assert [p for s in stages for p in s.parameters()] == list(model.parameters())
    for bad in ([0], [7], [9], [4, 2]):
        with pytest.raises(ValueError):
            split_model(model, bad)


@given(m=st.integers(1, 12), p=st.integers(1, 6))
def test_schedule_orders(m, p):
    for rank in range(p):
        for order in (gpipe_order(m), one_f_one_b_order(m, p, rank)):
            assert sorted(order) == sorted(
                [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
            )
            assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(m))
            check_order(order, m)  # what the executor accepts
        assert peak_live_in_order(one_f_one_b_order(m, p, rank)) == min(
            m, p - rank
        )  # 1F1B: p - k at most
        assert peak_live_in_order(gpipe_order(m)) == m  # GPipe: every micro-batch
    assert theory_bubble(p, m) == pytest.approx((p - 1) / (m + p - 1))


@given(m=st.integers(1, 12), p=st.integers(1, 5), v=st.integers(2, 3))
def test_interleaved_order_covers_each_stage_in_order(m, p, v):
    if m % max(1, m // p):
        with pytest.raises(ValueError):
            interleaved_1f1b_order(m, p, v, 0)
        return
    for rank in range(p):
        order = interleaved_1f1b_order(m, p, v, rank)
        stages = interleaved_stage_indices(p, v, rank)
        assert sorted(order) == sorted((k, i, s) for k in "FB" for i in range(m) for s in stages)
        for (
            s
        ) in stages:  # each stage takes its micro-batches in order in each direction, F before B
            assert [i for k, i, st_ in order if k == "F" and st_ == s] == list(range(m))
            assert [i for k, i, st_ in order if k == "B" and st_ == s] == list(range(m))
            assert all(order.index(("F", i, s)) < order.index(("B", i, s)) for i in range(m))


def test_orders_are_torchs():
    """Our GPipe and interleaved-1F1B orders are the ones torch 2.13's schedules compute (without running them).
    `_schedule_visualizer.get_schedule_ops` is private: if torch moves it, this test says so rather than passing."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    kind = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    for p, m, v in [(2, 4, 2), (2, 8, 2), (4, 8, 2), (4, 4, 2), (2, 6, 3), (4, 10, 2)]:
        ops = get_schedule_ops("Interleaved1F1B", p, m, v)
        for rank in range(p):
            theirs = [
                (kind[a.computation_type.name], a.microbatch_index, a.stage_index)
                for a in ops[rank]
                if a
            ]
            assert theirs == interleaved_1f1b_order(m, p, v, rank), (p, m, v, rank)
        gpipe = get_schedule_ops("GPipe", p, m)
        theirs = [
            (kind[a.computation_type.name], a.microbatch_index)
            for a in gpipe[0]
            if a and a.computation_type.name in kind
        ]
        assert theirs == gpipe_order(m)


def test_theory():
    assert [round(theory_bubble(2, m), 3) for m in (1, 2, 4, 8)] == [0.5, 0.333, 0.2, 0.111]
    assert theory_bubble(2, 4, 2) == pytest.approx(1 / 9)  # (p-1)/(v*m+p-1)
    assert theory_bubble(4, 8, 2) == pytest.approx(3 / 19)
    assert theory_speedup(2, 4) == pytest.approx(1.6)


def test_schedule_order_and_limits():
    assert schedule_order("torch-1f1b", 4, 2, 0) == one_f_one_b_order(4, 2, 0)
    assert schedule_order("torch-interleaved-1f1b", 4, 2, 1, 2) == interleaved_1f1b_order(
        4, 2, 2, 1
    )
    with pytest.raises(ValueError):
        schedule_order("zero-bubble", 4, 2, 0)
    assert schedule_limit("gpipe", 10, 4, 2) is None  # the hand-written executor takes 3, 3, 3, 1
    assert "divide N=10" in schedule_limit("torch-gpipe", 10, 4, 2)
    assert "m >= p" in schedule_limit("torch-1f1b", 32, 1, 2)
    assert "p = 2 divides m" in schedule_limit("torch-interleaved-1f1b", 32, 1, 2)
    assert "stages" in schedule_limit("torch-interleaved-1f1b", 32, 8, 4, 2, max_stages=5)
    assert "process group" in schedule_limit("torch-gpipe", 32, 4, 1, process_group=False)


def test_uneven_microbatches_weighted_loss_one_stage():
    """10 samples as 3, 3, 3, 1: weighting micro-batch means by n_i/N gives the full-batch loss and gradient;
    the plain mean of the micro-batch means does not."""
    torch.manual_seed(0)
    model = mlp([5, 7, 3])
    x, y = torch.randn(10, 5), torch.randint(0, 3, (10,))
    sizes = microbatch_sizes(10, 4)
    res = run_pipeline_step(
        model,
        gpipe_order(4),
        pp_rank=0,
        pp_world_size=1,
        sizes=sizes,
        recv_shape=(5,),
        inputs=list(x.split(sizes)),
        targets=list(y.split(sizes)),
        loss_fn=F.cross_entropy,
    )
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    full = F.cross_entropy(model(x), y)
    full.backward()
    assert abs(res.loss - full.item()) < TOL
    assert all(
        torch.allclose(a, b, atol=TOL) for a, b in zip(grads, (p.grad for p in model.parameters()))
    )
    with torch.no_grad():
        unweighted = torch.stack(
            [F.cross_entropy(model(a), b) for a, b in zip(x.split(sizes), y.split(sizes))]
        )
    assert (
        abs(unweighted.mean().item() - full.item()) > 1e-3
    )  # the weights matter with unequal sizes


@pytest.mark.parametrize(
    "order",
    [
        [("B", 0), ("F", 0)],
        [("F", 0), ("B", 1), ("F", 1), ("B", 0)],
        [("F", 0), ("F", 0)],
        [("F", 0)],
    ],
)
def test_executor_rejects_a_backward_before_its_forward_with_valueerror(order):
    """The promise in run_pipeline_step's docstring: a bad order is a ValueError before anything runs
    ([B0, F0] used to raise KeyError from inside the step)."""
    m = len({i for _, i in order}) if len(order) > 1 else 1
    model = mlp([3, 2])
    x, y = torch.randn(m, 3), torch.zeros(m, dtype=torch.long)
    with pytest.raises(ValueError, match="order|before its forward"):
        run_pipeline_step(
            model,
            order,
            pp_rank=0,
            pp_world_size=1,
            sizes=[1] * m,
            recv_shape=(3,),
            inputs=list(x.split(1)),
            targets=list(y.split(1)),
            loss_fn=F.cross_entropy,
        )
    assert all(p.grad is None for p in model.parameters())  # nothing ran


def torch_gpipe_on_uneven(rank: int, world_size: int):
    """One rank of a 2-stage torch ScheduleGPipe on 10 samples in 4 micro-batches, through the step lesson 09
    records (`recorded_pipeline_step`, at the lesson's defaults); returns the error this rank saw (None if
    none). Each rank catches its error and leaves, so that the peer's wait ends with a closed connection
    instead of the timeout."""
    from common.harness.env import DistInfo
    from common.harness.grid import Grid
    from common.harness.session import barrier
    from common.pipeline.step import recorded_pipeline_step

    args = importlib.import_module("lessons.09_model_parallel").parse_args(["--stage-ms", "0"])
    info = DistInfo(rank=rank, world_size=world_size, backend="gloo")
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(0))  # 10 flattened 8x8 digits
    y = torch.arange(10) % 10
    try:
        recorded_pipeline_step(
            "torch-gpipe",
            Grid(info, pp=world_size),
            x,
            y,
            4,
            widths=args.widths,
            split_points=args.split_points,
            seed=args.seed,
            lr=args.lr,
            stage_ms=0.0,
            device=info.device,
            barrier=lambda: barrier(info),
        )
    except Exception as e:  # noqa: BLE001 -- what torch raises is the thing under test
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.slow  # two spawned processes importing torch: about 5 s, kept out of the fast subset
@pytest.mark.timeout(90)
def test_torch_pipelining_fails_on_uneven_microbatches(tmp_path):
    """torch 2.13's schedules cut 10 samples as 3, 3, 2, 2 and the last stage reuses the first
    micro-batch's shape, so the loss fails; its peer is left waiting for a gradient. In its own processes with
    its own timeout. If a later torch fixes this, the test fails and the lesson's sentence must change."""
    errors = run_world(torch_gpipe_on_uneven, 2, tmp_path, timeout_s=60)
    assert (
        errors[1] is not None
        and "Expected input batch_size (3) to match target batch_size (2)" in errors[1]
    )
    assert errors[0] is not None  # stage 0 does not finish its step either
