"""Every collective run once and checked against the answer each rank computes locally (lesson 02).

Rank k contributes x_k = [0 1 2 3] + 100 k: integers in float32, so every sum is exact and any rank can
compute what every collective must return. A check's number is 0.0 when the collective is right (max |error|,
arrivals missed, a fallback used); the lesson takes the worst rank's with `max_over_ranks` and claims it.

    err, waited = run_collectives(info)                  # {check: this rank's number}, its wait in the barrier
    row = ring_vs_all_reduce(info, length=1001, seed=0)  # the ring from isend/irecv against dist.all_reduce
    busiest_link(info, ring_all_reduce, m=2, group=g, psi=1024)   # bytes in + out on the busiest link

The barrier is checked without comparing clocks across ranks (two nodes have two clocks): the last rank arrives
late on purpose, and every rank reads, after the barrier, how many ranks had counted themselves in torchrun's
key-value store before it.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from common.collectives.ring import LinkStats, ring_all_reduce
from common.measure.differences import max_abs_diff, max_over_ranks, nan_max

__all__ = ["DEMO_LEN", "busiest_link", "check_barrier", "run_collectives", "ring_vs_all_reduce"]

DEMO_LEN = (
    4  # elements in the small tensors each collective demonstrates on (printed, so kept short)
)


def _point_to_point(info, x) -> dict[str, float]:
    """send/recv (rank 0 -> rank 1) and a ring shift with batch_isend_irecv; needs 2+ ranks."""
    n, r, dev = info.world_size, info.rank, info.device
    buf = torch.empty(DEMO_LEN, device=dev)
    if r == 0:
        dist.send(x(0), dst=1)  # blocking
    elif r == 1:
        dist.recv(buf, src=0)
    err = {
        "send_recv": max_abs_diff(buf, x(0)) if r == 1 else 0.0
    }  # only rank 1 has something to check
    # everybody shifts its tensor one step right on the ring at once: blocking sends in that pattern could all
    # wait for a receive nobody has posted yet; batch_isend_irecv posts each rank's send and receive together
    buf = torch.empty(DEMO_LEN, device=dev)
    ops = [dist.P2POp(dist.isend, x(r), (r + 1) % n), dist.P2POp(dist.irecv, buf, (r - 1) % n)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    err["isend_irecv_ring_shift"] = max_abs_diff(buf, x((r - 1) % n))
    return err


def run_collectives(info, late_s: float = 0.05) -> tuple[dict[str, float], float]:
    """Every collective once, each result compared with the local answer; returns {check: this rank's number},
    0.0 meaning right (max |error|, arrivals missed, fallback used), and this rank's wait in the barrier."""
    n, r, dev = info.world_size, info.rank, info.device

    def x(k: int) -> torch.Tensor:  # rank k's input [100k, 100k+1, 100k+2, 100k+3]
        return torch.arange(DEMO_LEN, dtype=torch.float32, device=dev) + 100 * k

    total = sum(x(k) for k in range(n))
    err = _point_to_point(info, x) if n >= 2 else {}
    t = x(r)
    dist.broadcast(t, src=0)  # everybody ends with rank 0's tensor
    err["broadcast"] = max_abs_diff(t, x(0))
    t = x(r)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)  # everybody ends with the sum
    err["all_reduce"] = max_abs_diff(t, total)
    t = x(r)
    dist.reduce(
        t, dst=0, op=dist.ReduceOp.SUM
    )  # only rank 0's result is defined; the others' are scratch
    err["reduce"] = max_abs_diff(t, total) if r == 0 else 0.0
    parts = [torch.empty(DEMO_LEN, device=dev) for _ in range(n)]
    dist.all_gather(parts, x(r))  # everybody ends with every rank's tensor, in rank order
    err["all_gather"] = nan_max(max_abs_diff(parts[k], x(k)) for k in range(n))
    # reduce_scatter: rank k contributes [x_k + 1000 j for j in ranks]; rank j ends with the sum of the j-th
    # entries. It is the first half of the ring all-reduce. MPI lacks it (docs table): from all_reduce then.
    inputs, got = [x(r) + 1000 * j for j in range(n)], torch.empty(DEMO_LEN, device=dev)
    try:
        dist.reduce_scatter(got, inputs, op=dist.ReduceOp.SUM)
        err["reduce_scatter_fallback"] = 0.0
    except (RuntimeError, NotImplementedError):  # fallback: 2x a ring reduce-scatter's link bytes
        err["reduce_scatter_fallback"] = 1.0
        full = torch.cat(inputs)
        dist.all_reduce(full)
        got = full[r * DEMO_LEN : (r + 1) * DEMO_LEN]
    err["reduce_scatter"] = max_abs_diff(got, total + 1000 * r * n)
    err["barrier_missed_arrivals"], waited = check_barrier(info, late_s)
    return err, waited


def check_barrier(info, late_s: float) -> tuple[int, float]:
    """The last rank arrives `late_s` late; returns (arrivals a rank had not seen when it left the barrier,
    this rank's own wait in it).

    Each rank counts itself in torchrun's key-value store (reachable from every node) before the barrier;
    after it, a rank that left before the last arrival would read fewer than n. No clock is compared across
    ranks.
    """
    n = info.world_size
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=60),
    )
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    key = f"lesson02/arrived/{run_id}/{attempt}"
    if info.rank == n - 1:
        time.sleep(late_s)  # the last rank arrives late on purpose
    store.add(key, 1)
    t0 = time.perf_counter()
    dist.barrier()
    waited = time.perf_counter() - t0  # this rank's own clock: valid on any node
    return n - store.add(key, 0), waited  # add 0 reads the counter


def ring_vs_all_reduce(info, length: int, seed: int) -> dict:
    """The ring from isend/irecv and dist.all_reduce on `length` integers and `length` floats: the worst rank's
    max |diff| on each. Integers in float32 sum exactly, so there the two must agree bit for bit; floats may
    differ in the last bit (the ring adds around the ring, gloo in its own order)."""
    gen = torch.Generator().manual_seed(seed * 1000 + 17 * info.rank + length)
    integers = torch.randint(-1000, 1000, (length,), generator=gen).float()
    data = torch.cat([integers, torch.randn(length, generator=gen)]).to(
        info.device
    )  # (2 * length,)
    ring, ref = ring_all_reduce(data.clone()), data.clone()
    dist.all_reduce(ref)
    return {
        "length": length,
        "int_diff": max_over_ranks(max_abs_diff(ring[:length], ref[:length])),
        "float_diff": max_over_ranks(max_abs_diff(ring[length:], ref[length:])),
    }


def busiest_link(info, fn, m: int, group, psi: int) -> int:
    """Bytes in + out on the busiest link when ranks 0..m-1 sum a `psi`-element float32 tensor with `fn`
    (`ring_all_reduce` or `parameter_server_all_reduce`); every rank calls it, the others send nothing."""
    stats = LinkStats()
    if info.rank < m:  # the others are not in `group`
        fn(torch.ones(psi, device=info.device), stats=stats, group=group)
    return int(max_over_ranks(float(stats.link_bytes)))
