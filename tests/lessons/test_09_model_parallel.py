"""Lesson 07: pipelined = unsplit (loss, gradients, parameters), the bubble, memory, uneven micro-batches, errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from common.launch import run_lesson
from tests._lessons import assert_fails_on_every_rank
from common.models import mlp
from common.pipeline import (default_split_points, gpipe_order, microbatch_sizes, one_f_one_b_order,
                             run_pipeline_step, split_model, theory_bubble)

TOL = 1e-5


# ------------------------------------------------------------------------------------------ unit tests
def test_microbatch_sizes():
    assert microbatch_sizes(10, 4) == [3, 3, 3, 1]
    assert microbatch_sizes(8, 4) == [2, 2, 2, 2]
    assert [t.shape[0] for t in torch.arange(10).chunk(4)] == microbatch_sizes(10, 4)  # torch.chunk's cut
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
            assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(m))
        live = peak = 0
        for kind, _ in one_f_one_b_order(m, p, rank):
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        assert peak == min(m, p - rank)  # 1F1B: stage k holds at most p - k micro-batches (GPipe: m)
    assert theory_bubble(p, m) == pytest.approx((p - 1) / (m + p - 1))


def test_uneven_microbatches_weighted_loss_one_stage():
    """10 samples as 3, 3, 3, 1: weighting micro-batch means by n_i/N gives the full-batch loss and gradient;
    the plain mean of the micro-batch means does not."""
    torch.manual_seed(0)
    model = mlp([5, 7, 3])
    x, y = torch.randn(10, 5), torch.randint(0, 3, (10,))
    sizes = microbatch_sizes(10, 4)
    res = run_pipeline_step(model, gpipe_order(4), pp_rank=0, pp_world_size=1, sizes=sizes, recv_shape=(5,),
                            inputs=list(x.split(sizes)), targets=list(y.split(sizes)), loss_fn=F.cross_entropy)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    full = F.cross_entropy(model(x), y)
    full.backward()
    assert abs(res.loss - full.item()) < TOL
    assert all(torch.allclose(a, b, atol=TOL) for a, b in zip(grads, (p.grad for p in model.parameters())))
    with torch.no_grad():
        unweighted = torch.stack([F.cross_entropy(model(a), b) for a, b in zip(x.split(sizes), y.split(sizes))])
    assert abs(unweighted.mean().item() - full.item()) > 1e-3  # the weights matter with unequal sizes


# ------------------------------------------------------------------------------------------ the lesson
def _check_rows(rows, p, schedules, ms):
    got = {(r["schedule"], r["m"]) for r in rows}
    want = {(s, m) for s in schedules for m in ms if not (s == "torch-1f1b" and m < p)}
    assert got == want
    for r in rows:
        assert r["n_params"]
        assert r["loss_diff"] < TOL and r["grad_diff"] < TOL and r["param_diff"] < TOL, r["schedule"]
        m = r["m"]
        if r["schedule"].endswith("gpipe"):
            assert r["peak_live"] == [m] * p  # every stage holds every micro-batch
        else:
            assert r["peak_live"] == [min(m, p - k) for k in range(p)]


@pytest.mark.timeout(400)
def test_two_stages_equal_unsplit_bubble_memory_uneven():
    # 120 ms of simulated stage work per batch: at m=8 a micro-batch forward is 15 ms, backward 30 ms, far above
    # send/recv latency and scheduler noise, so the measured idle fraction tracks (p-1)/(m+p-1).
    run = run_lesson("09_model_parallel", nproc=2, args=["--stage-ms", "120", "--bench-steps", "1",
                                                         "--bench-width", "256", "--bench-batch", "32"],
                     timeout_s=360).check()
    res = run.results
    _check_rows(res["rows"], 2, ["gpipe", "1f1b", "torch-gpipe", "torch-1f1b"], [1, 2, 4, 8])
    for r in res["rows"]:
        assert abs(r["bubble"] - r["theory_bubble"]) < 0.1, (r["schedule"], r["m"], r["bubble"])
    # memory: GPipe's stage 0 holds the whole batch's activations for any m; 1F1B's holds 2 of m micro-batches
    by = {(r["schedule"], r["m"]): r["peak_activation_bytes"] for r in res["rows"]}
    assert by[("gpipe", 8)][0] == by[("gpipe", 1)][0] > 0
    assert by[("1f1b", 8)][0] == pytest.approx(by[("gpipe", 8)][0] * 2 / 8)
    assert by[("1f1b", 8)][1] == pytest.approx(by[("gpipe", 8)][1] / 8)
    # the naive split: under torchrun it stays on this rank's device (simulated), and computes the unsplit
    # model's numbers. (Its stages run one after the other by construction; the idle fraction illustrates that.)
    naive = res["naive"]
    assert naive["simulated"]
    assert naive["loss_diff"] < TOL and naive["grad_diff"] < TOL
    assert abs(naive["idle_fraction"] - 0.5) < 0.1
    assert res["uneven"]["sizes"] == [3, 3, 3, 1]
    assert res["uneven"]["loss_diff"] < TOL and res["uneven"]["grad_diff"] < TOL
    assert "within 1e-5: True" in run.stdout


@pytest.mark.timeout(400)
def test_four_stages_equal_unsplit():
    run = run_lesson("09_model_parallel", nproc=4, args=["--stage-ms", "0", "--bench-steps", "0",
                                                         "--batch-size", "16"], timeout_s=360).check()
    assert run.results["world_size"] == 4
    _check_rows(run.results["rows"], 4, ["gpipe", "1f1b", "torch-gpipe", "torch-1f1b"], [1, 2, 4, 8])
    assert run.results["uneven"]["loss_diff"] < TOL


@pytest.mark.timeout(200)
def test_plain_python_one_stage():
    run = run_lesson("09_model_parallel", nproc=None, args=["--stage-ms", "0", "--microbatches", "1,4"],
                     timeout_s=120).check()
    rows = run.results["rows"]
    assert [(r["schedule"], r["m"]) for r in rows] == [("gpipe", 1), ("gpipe", 4), ("1f1b", 1), ("1f1b", 4)]
    assert all(r["grad_diff"] < TOL and r["param_diff"] < TOL for r in rows)
    assert "skipped: needs a process group" in run.stdout


@pytest.mark.timeout(200)
@pytest.mark.parametrize("args, message", [
    (["--stages", "3"], "3 pipeline stages need 3 processes"),
    (["--microbatches", "64"], "64 micro-batches need at least 64 samples"),
    (["--split-points", "12"], "split point 12 is outside the model"),
])
def test_bad_input_fails_on_every_rank(args, message):
    run = run_lesson("09_model_parallel", nproc=2, args=args, timeout_s=120)
    assert_fails_on_every_rank(run, 2, message)
