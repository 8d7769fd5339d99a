"""Timing a collective and turning the time into bandwidth, as nccl-tests does (lesson 02, benchmarks/).

algbw = S / t is what the caller sees for S bytes in t seconds; busbw = algbw * factor(op, n) is what each link
must carry, comparable across world sizes (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).
For all-reduce the factor is 2(n-1)/n, the share of the tensor a ring rank sends (`common.collectives.ring`):
`ring_bytes_sent` is the one implementation of the ring's traffic factors.

`time_calls` times each call on its own (after warm-up calls), so that a reader gets a median and a spread rather
than one mean that a single slow call can dominate.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = [
    "RING_SHARE",
    "ring_bytes_sent",
    "bus_bandwidth_factor",
    "bandwidths",
    "time_calls",
    "five_number_summary",
]

RING_SHARE = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}  # x (n-1)/n of the buffer


def ring_bytes_sent(op: str, nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring `op` on a buffer of `nbytes` (the full tensor) over `world_size` ranks.

    all_reduce 2 B (n-1)/n (a reduce-scatter, then an all-gather); reduce_scatter, all_gather B (n-1)/n. The one
    home of the ring's traffic factors: nccl-tests' busbw factor (`bus_bandwidth_factor`) is this for B = 1, the
    planner's cost model (`common.planning.cost_model`) uses it as it is. Multiplied before the division, so a
    count of bytes that n divides stays a whole number.

    Raises:
        ValueError: an op the ring model does not cover, or world_size < 1.
    """
    if world_size < 1 or op not in RING_SHARE:
        raise ValueError(
            f"need an op in {sorted(RING_SHARE)} and world_size >= 1, got {op!r}, {world_size}"
        )
    return RING_SHARE[op] * nbytes * (world_size - 1) / world_size


def bus_bandwidth_factor(op: str, world_size: int) -> float:
    """busbw / algbw for a collective on `world_size` ranks, as nccl-tests defines it.

    all_reduce: 2(n-1)/n; reduce_scatter, all_gather: (n-1)/n (`ring_bytes_sent` of one byte); broadcast, reduce:
    1. 0 for n = 1: nothing moves.

    Raises:
        ValueError: unknown op or world_size < 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ops = sorted([*RING_SHARE, "broadcast", "reduce"])
    if op not in ops:
        raise ValueError(f"unknown op {op!r}; one of {ops}")
    if world_size == 1:
        return 0.0
    return ring_bytes_sent(op, 1, world_size) if op in RING_SHARE else 1.0


def bandwidths(
    size_bytes: int, seconds: float, world_size: int, op: str = "all_reduce"
) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s) for one call moving `size_bytes` per rank in `seconds`.

    Raises:
        ValueError: seconds <= 0 or size_bytes < 0.
    """
    if seconds <= 0 or size_bytes < 0:
        raise ValueError(f"need seconds > 0 and size_bytes >= 0, got {seconds}, {size_bytes}")
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * bus_bandwidth_factor(op, world_size)


def time_calls(
    fn: Callable[[], object], iters: int, warmup: int, device: torch.device, distributed: bool
) -> list[float]:
    """Seconds of each of `iters` calls of `fn` after `warmup` untimed calls; per call, the max over ranks.

    Before each call a barrier lines the ranks up (so one call's stragglers do not spill into the next) and on
    CUDA the device is synchronised around it (kernels are asynchronous). A collective is finished only when
    every rank has its result, so each call's time is the slowest rank's (one all-reduce with MAX at the end).
    Every rank returns the same list.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got {iters}, {warmup}")
    for _ in range(warmup):
        fn()
    times = torch.zeros(iters, dtype=torch.float64)
    for i in range(iters):
        if distributed:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times[i] = time.perf_counter() - t0
    times = times.to(device)
    if distributed:
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.cpu().tolist()


def five_number_summary(seconds: list[float]) -> dict[str, float]:
    """{"median", "q1", "q3", "min", "max"} of per-call times (quartiles: statistics.quantiles, n=4)."""
    if not seconds:
        raise ValueError("no times to summarise")
    q1, _, q3 = statistics.quantiles(seconds, n=4) if len(seconds) > 1 else (seconds[0],) * 3
    return {
        "median": statistics.median(seconds),
        "q1": q1,
        "q3": q3,
        "min": min(seconds),
        "max": max(seconds),
    }
