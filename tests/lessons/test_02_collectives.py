"""Lesson 02: collectives checked against local answers, the hand-built ring all-reduce, bandwidth, no server.

Unit and property tests of common.collectives (the ring schedule, chunking, simulation, bandwidth formulas), then
the lesson launched as users launch it: torchrun with 2 processes (the full check), with 1, 3 and 4 processes
(ring == dist.all_reduce on uneven lengths in worlds of 1..4), plain python, and bad input.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from common.collectives import (BACKEND_OPS, BACKEND_SUPPORT, bandwidths, bus_bandwidth_factor, chunk_bounds,
                                ring_schedule, simulate_ring_all_reduce)
from common.launch import run_lesson
from tests._lessons import assert_fails_on_every_rank

UNEVEN_LENGTHS = ["1", "2", "3", "5", "7", "1001"]  # none divisible by 4; 1, 2, 3 are smaller than 4 ranks


def run_ok(nproc, args, timeout_s=200):
    """Launch the lesson and require success (any failure, at exit included, fails the test)."""
    return run_lesson("02_collectives", nproc=nproc, args=args, timeout_s=timeout_s).check()


# ---------------------------------------------------------------------------------------------------- unit tests
@given(length=st.integers(0, 5000), n=st.integers(1, 16))
def test_chunk_bounds_cover_the_tensor_in_nearly_equal_pieces(length, n):
    bounds = chunk_bounds(length, n)
    assert len(bounds) == n
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, no gap, no overlap
    sizes = [e - s for s, e in bounds]
    assert max(sizes) - min(sizes) <= 1 and sorted(sizes, reverse=True) == sizes
    assert sizes == [len(c) for c in torch.arange(length).tensor_split(n)]  # same split as torch


def test_chunk_bounds_rejects_bad_input():
    with pytest.raises(ValueError):
        chunk_bounds(-1, 2)
    with pytest.raises(ValueError):
        chunk_bounds(3, 0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_ring_schedule_sender_and_receiver_agree_and_each_rank_owns_one_chunk(n):
    for phase in ("reduce_scatter", "all_gather"):
        for step in range(n - 1):
            for r in range(n):
                sent, _ = ring_schedule(r, n, phase, step)
                _, received_by_right = ring_schedule((r + 1) % n, n, phase, step)
                assert sent == received_by_right
            # at each step the n ranks send n different chunks: every link is busy with a different piece
            assert sorted(ring_schedule(r, n, phase, step)[0] for r in range(n)) == list(range(n))
    # the chunk rank r completes in reduce-scatter is the one it sends first in all-gather
    for r in range(n):
        if n > 1:
            assert ring_schedule(r, n, "reduce_scatter", n - 2)[1] == (r + 1) % n
            assert ring_schedule(r, n, "all_gather", 0)[0] == (r + 1) % n
    with pytest.raises(ValueError):
        ring_schedule(0, 2, "broadcast", 0)


@given(n=st.integers(1, 6), length=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_simulated_ring_equals_plain_sum(n, length, seed):
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randint(-100, 100, (length,), generator=g).float() for _ in range(n)]
    results, log = simulate_ring_all_reduce(inputs)
    total = torch.stack(inputs).sum(0)
    for res in results:
        assert torch.equal(res, total)
    assert len(log) == 2 * (n - 1) * n  # 2(n-1) steps, n messages per step


def test_simulation_can_fail_when_the_schedule_is_wrong(monkeypatch):
    """The check has teeth: a schedule that adds the wrong chunk gives a wrong sum."""
    import common.collectives as cc
    real = cc.ring_schedule
    monkeypatch.setattr(cc, "ring_schedule",
                        lambda r, n, phase, step: (real(r, n, phase, step)[0],) * 2)  # ignores the neighbour
    inputs = [torch.full((6,), float(r + 1)) for r in range(3)]
    with pytest.raises(AssertionError):
        results, _ = cc.simulate_ring_all_reduce(inputs)
        assert all(torch.equal(res, torch.full((6,), 6.0)) for res in results)


def test_bus_bandwidth_factors_follow_nccl_tests():
    assert bus_bandwidth_factor("all_reduce", 2) == 1.0
    assert bus_bandwidth_factor("all_reduce", 4) == 1.5
    assert bus_bandwidth_factor("all_reduce", 8) == 2 * 7 / 8
    assert bus_bandwidth_factor("all_gather", 4) == 0.75
    assert bus_bandwidth_factor("reduce_scatter", 4) == 0.75
    assert bus_bandwidth_factor("broadcast", 4) == 1.0
    assert bus_bandwidth_factor("all_reduce", 1) == 0.0
    algbw, busbw = bandwidths(4_000_000, 0.002, 4)
    assert algbw == pytest.approx(2.0) and busbw == pytest.approx(3.0)
    with pytest.raises(ValueError):
        bandwidths(1024, 0.0, 2)
    with pytest.raises(ValueError):
        bus_bandwidth_factor("all_to_all_v", 2)


def test_backend_table_matches_the_docs_on_key_facts():
    assert set(BACKEND_SUPPORT[("gloo", "cpu")]) == set(BACKEND_OPS)
    assert not any(BACKEND_SUPPORT[("nccl", "cpu")].values())  # NCCL moves CUDA tensors only
    assert all(BACKEND_SUPPORT[("nccl", "cuda")].values())
    assert BACKEND_SUPPORT[("mpi", "cpu")]["reduce_scatter"] is False


# ---------------------------------------------------------------------------------------------- lesson launches
def _check_ring_results(res: dict, n: int) -> None:
    ring = res["ring_vs_all_reduce"]
    assert [row["length"] for row in ring["rows"]] == [int(x) for x in UNEVEN_LENGTHS]
    for row in ring["rows"]:
        assert row["exact_int_equal"] is True, row
        assert row["float_max_abs_diff"] < 1e-4, row  # float32 sums of n ~N(0,1) values, other order
    assert ring["messages_sent_per_rank"] == 2 * (n - 1)
    assert ring["bytes_ratio"] == pytest.approx(2 * (n - 1) / n)
    assert ring["bytes_ratio"] == pytest.approx(ring["expected_ratio"])


def _check_collectives(res: dict, n: int) -> None:
    ops = res["collectives"]
    expected = {"broadcast", "all_reduce", "reduce", "all_gather", "reduce_scatter", "barrier"}
    if n >= 2:
        expected |= {"send_recv", "isend_irecv_ring_shift"}
    assert set(ops) == expected
    for op, c in ops.items():
        assert c["ok"] is True, (op, c)
        if op != "barrier":
            assert c["max_abs_err"] == 0.0, (op, c)
    if res["backend"] == "gloo":
        assert ops["reduce_scatter"]["native"] is True  # gloo on CPU supports it in torch 2.13


@pytest.mark.timeout(450)
def test_lesson_two_processes_checks_every_claim():
    sizes = ["4", "64"]
    run = run_ok(2, ["--sizes-kib", *sizes, "--iters", "3", "--warmup", "1", "--lengths", *UNEVEN_LENGTHS])
    res = run.results
    assert res["world_size"] == 2 and res["distributed"] is True
    assert [(f["rank"], f["local_rank"], f["world_size"]) for f in res["ranks"]] == [(0, 0, 2), (1, 1, 2)]
    assert res["backends_built"]["gloo"] is True
    _check_collectives(res, 2)
    _check_ring_results(res, 2)
    assert res["ring_simulation"]["all_equal_plain_sum"] is True

    bw = res["bandwidth"]
    assert [(r["op"], r["size_bytes"]) for r in bw] == [(op, int(s) * 1024) for s in sizes
                                                        for op in ("all_reduce", "ring")]
    for r in bw:
        assert r["time_s"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / r["time_s"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (2 - 1) / 2)

    ps = res["no_parameter_server"]
    assert ps["global_batch"] == 2 * ps["batch_size_per_process"]
    assert ps["collectives_called"] == {"all_reduce": 1, "broadcast": 0, "send": 0}
    assert ps["grad_max_diff_across_ranks"] == 0.0  # every rank holds the same averaged gradient
    assert ps["param_max_diff_across_ranks"] == 0.0  # and steps to identical parameters by itself
    assert ps["grad_max_diff_vs_global_batch"] < 1e-6  # = the gradient of the global batch in one process
    assert ps["param_max_diff_vs_global_batch"] < 1e-6
    assert ps["ring_bytes_per_rank"] < ps["server_bytes_in_plus_out"]
    # deterministic summary on stdout, timings only on [perf] lines
    assert "match on every rank: False" not in run.stdout
    assert len(run.lines(perf=True)) == len(bw)


@pytest.mark.slow
@pytest.mark.timeout(450)
@pytest.mark.parametrize("nproc", [1, 3, 4])
def test_ring_equals_all_reduce_in_worlds_of_1_3_4(nproc):
    run = run_ok(nproc, ["--sizes-kib", "4", "--iters", "1", "--warmup", "0", "--lengths", *UNEVEN_LENGTHS])
    res = run.results
    assert res["world_size"] == nproc
    _check_collectives(res, nproc)
    _check_ring_results(res, nproc)
    ps = res["no_parameter_server"]
    assert ps["grad_max_diff_across_ranks"] == 0.0 and ps["param_max_diff_across_ranks"] == 0.0
    assert ps["grad_max_diff_vs_global_batch"] < 1e-6


@pytest.mark.timeout(180)
def test_lesson_plain_python_runs_without_a_process_group():
    run = run_lesson("02_collectives", nproc=None, timeout_s=150, args=["--lengths", *UNEVEN_LENGTHS])
    run.check()
    res = run.results
    assert res["distributed"] is False and res["backend"] is None and res["world_size"] == 1
    assert res["collectives"] == {} and res["bandwidth"] == []
    assert res["ring_simulation"]["all_equal_plain_sum"] is True
    ps = res["no_parameter_server"]
    assert ps["collectives_called"]["all_reduce"] == 0
    assert ps["grad_max_diff_vs_global_batch"] == 0.0 and ps["param_max_diff_vs_global_batch"] == 0.0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("bad, message", [(["--sizes-kib", "0"], "--sizes-kib must be positive"),
                                          (["--lengths", "3", "-2"], "--lengths must be positive")])
def test_bad_input_is_one_line_on_every_rank(bad, message):
    run = run_lesson("02_collectives", nproc=2, args=bad, timeout_s=150)
    assert_fails_on_every_rank(run, 2, message)
    assert run.results is None


@pytest.mark.timeout(120)
def test_negative_message_size_in_plain_python():
    run = run_lesson("02_collectives", nproc=None, args=["--sizes-kib", "64", "-4"], timeout_s=100)
    assert run.returncode == 2
    assert "error: --sizes-kib must be positive integers (KiB), got -4" in run.stderr
