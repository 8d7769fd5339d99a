"""Lesson 02's subject matter without a process group: the ring schedule, chunking, the simulated ring, the bytes a
ring and a parameter server put on their links, bandwidth formulas, per-call timing, the backend table; and the
MAX over ranks that lessons 10-11 compare with, in a spawned world of 3 whose ranks disagree."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import common.collectives.ring as ring
from common.collectives.backends import BACKEND_OPS, BACKEND_SUPPORT, backend_table
from common.collectives.ring import (
    chunk_bounds,
    ring_link_bytes,
    ring_schedule,
    server_link_bytes,
    simulate_ring_all_reduce,
    simulation_equals_sum,
)
from common.measure.bandwidth import (
    bandwidths,
    bus_bandwidth_factor,
    five_number_summary,
    time_calls,
)
from common.measure.differences import max_over_ranks
from tests._rank_workers import max_over_ranks_of_different_values
from tests._workers import run_world


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
    """The check has teeth: a schedule that adds the wrong chunk gives a wrong sum, and the lesson's claim drops."""
    assert simulation_equals_sum(range(1, 5), [1, 3, 7, 1001])
    real = ring.ring_schedule
    monkeypatch.setattr(
        ring, "ring_schedule", lambda r, n, phase, step: (real(r, n, phase, step)[0],) * 2
    )  # ignores the neighbour
    inputs = [torch.full((6,), float(r + 1)) for r in range(3)]
    with pytest.raises(AssertionError):
        results, _ = ring.simulate_ring_all_reduce(inputs)
        assert all(torch.equal(res, torch.full((6,), 6.0)) for res in results)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_link_bytes_counted_from_the_simulated_schedule_match_the_formula(n):
    """In + out per simulated rank, counted message by message, is 4(n-1)/n x the tensor: exact when n divides it."""
    psi = 1024  # float32 elements, 4096 bytes
    _, log = simulate_ring_all_reduce([torch.ones(psi) for _ in range(n)])
    link = [sum(m["bytes"] for m in log if r in (m["src"], m["dst"])) for r in range(n)]
    assert link == [ring_link_bytes(n, 4 * psi)] * n
    assert ring_link_bytes(n, 4 * psi) == 4 * (n - 1) * 4 * psi / n


@pytest.mark.parametrize(
    "n, ring_bytes, server_bytes", [(2, 8192, 8192), (4, 12288, 24576), (8, 14336, 57344)]
)
def test_server_link_carries_n_over_2_times_a_ring_link(n, ring_bytes, server_bytes):
    assert ring_link_bytes(n, 4096) == ring_bytes
    assert server_link_bytes(n, 4096) == server_bytes
    assert server_link_bytes(n, 4096) / ring_link_bytes(n, 4096) == n / 2  # equal at n = 2


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


def test_time_calls_times_each_call_after_warmup_and_five_number_summary_summarises():
    calls = []
    times = time_calls(
        lambda: calls.append(1), iters=20, warmup=3, device=torch.device("cpu"), distributed=False
    )
    assert len(calls) == 23 and len(times) == 20 and all(t >= 0 for t in times)
    s = five_number_summary([5.0, 1.0, 2.0, 4.0, 3.0])
    assert s["median"] == 3.0 and s["min"] == 1.0 and s["max"] == 5.0 and s["q1"] <= 3.0 <= s["q3"]
    assert five_number_summary([2.0]) == {
        "median": 2.0,
        "q1": 2.0,
        "q3": 2.0,
        "min": 2.0,
        "max": 2.0,
    }
    with pytest.raises(ValueError):
        time_calls(lambda: None, iters=0, warmup=0, device=torch.device("cpu"), distributed=False)


def test_backend_table_matches_the_docs_on_key_facts():
    assert set(BACKEND_SUPPORT[("gloo", "cpu")]) == set(BACKEND_OPS)
    assert not any(BACKEND_SUPPORT[("nccl", "cpu")].values())  # NCCL moves CUDA tensors only
    assert all(BACKEND_SUPPORT[("nccl", "cuda")].values())
    assert BACKEND_SUPPORT[("mpi", "cpu")]["reduce_scatter"] is False
    lines = backend_table({"gloo": True, "nccl": False, "mpi": False})
    assert len(lines) == 1 + len(BACKEND_OPS) + 1
    assert lines[-1].split() == ["built", "here", "yes", "yes", "no", "no", "no", "no"]
    assert lines[1 + BACKEND_OPS.index("reduce_scatter")].split() == [
        "reduce_scatter",
        "yes",
        "yes",
        "no",
        "no",
        "no",
        "yes",
    ]
    # the docs' all_to_all row: not on gloo (although gloo on CPU runs it in torch 2.13: common/collectives/backends.py)
    assert lines[1 + BACKEND_OPS.index("all_to_all")].split() == [
        "all_to_all",
        "no",
        "no",
        "yes",
        "?",
        "no",
        "yes",
    ]


@pytest.mark.timeout(120)
def test_max_over_ranks_returns_the_largest_rank_value_on_every_rank(tmp_path):
    # ranks that disagree: a reduction with MIN (or rank 0's own value) would hide the diverging rank
    out = run_world(max_over_ranks_of_different_values, 3, tmp_path, timeout_s=100)
    assert out == [[17.0, -1.5]] * 3
    assert max_over_ranks(2.5) == 2.5  # no process group: the value itself
