"""A ring all-reduce built from send/recv, its schedule, and bandwidth helpers (introduced in lesson 02).

The ring all-reduce (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations",
JPDC 2009; the algorithm Baidu brought to deep learning in 2017) splits a tensor of S bytes into n chunks, one
per rank, and runs two phases of n-1 steps each on a ring rank -> rank+1:

    reduce-scatter  at step s rank r sends chunk (r - s) mod n to rank r+1, receives chunk (r - s - 1) mod n
                    from rank r-1 and ADDS it into its own copy. After n-1 steps rank r holds the complete
                    sum of chunk (r + 1) mod n.
    all-gather      at step s rank r sends chunk (r + 1 - s) mod n, receives chunk (r - s) mod n and
                    OVERWRITES its copy. After n-1 more steps every rank holds every summed chunk.

Each rank sends 2(n-1) chunks of about S/n bytes: 2(n-1)/n * S in all, independent of n for large n. That is
why nccl-tests reports a "bus bandwidth" busbw = algbw * 2(n-1)/n for all-reduce
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md): it is the speed each link must sustain.

The same `ring_schedule` drives the real implementation (`ring_all_reduce`, isend/irecv between processes) and
the in-process simulation (`simulate_ring_all_reduce`) that the notebook draws, so the picture shows the code.

DDP does not call this function: it hands gradient buckets to the backend's all_reduce, and NCCL picks ring or
tree algorithms by message size and topology. The ring is the model for the *bandwidth* cost of all-reduce.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "BACKEND_SUPPORT", "BACKEND_OPS", "chunk_bounds", "ring_schedule", "RingStats", "ring_all_reduce",
    "simulate_ring_all_reduce", "bus_bandwidth_factor", "bandwidths", "time_op",
]

# The table in https://pytorch.org/docs/stable/distributed.html#backends (torch 2.x): which backend supports
# which function on CPU / GPU tensors. True = supported, False = not, None = "?" (MPI on GPU depends on how MPI
# was built). The lesson prints it and measures the column of the backend it actually runs on.
BACKEND_OPS = ["send", "recv", "broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter",
               "reduce_scatter", "all_to_all", "barrier"]
_Y, _N, _Q = True, False, None
BACKEND_SUPPORT: dict[tuple[str, str], dict[str, bool | None]] = {
    ("gloo", "cpu"): dict.fromkeys(BACKEND_OPS, _Y),
    ("gloo", "cuda"): {**dict.fromkeys(BACKEND_OPS, _Y), "send": _N, "recv": _N, "barrier": _N},
    ("mpi", "cpu"): {**dict.fromkeys(BACKEND_OPS, _Y), "reduce_scatter": _N},
    ("mpi", "cuda"): {**dict.fromkeys(BACKEND_OPS, _Q), "reduce_scatter": _N},
    ("nccl", "cpu"): dict.fromkeys(BACKEND_OPS, _N),
    ("nccl", "cuda"): dict.fromkeys(BACKEND_OPS, _Y),
}


def chunk_bounds(length: int, world_size: int) -> list[tuple[int, int]]:
    """Split `length` elements into `world_size` contiguous chunks whose sizes differ by at most one.

    The first `length % world_size` chunks get one extra element (as `torch.tensor_split` does). When
    length < world_size the last chunks are empty: a ring step on an empty chunk sends nothing.

    Returns:
        [(start, end), ...] with world_size entries, end exclusive; e.g. (7, 3) -> [(0, 3), (3, 5), (5, 7)].

    Raises:
        ValueError: length < 0 or world_size < 1.
    """
    if length < 0 or world_size < 1:
        raise ValueError(f"need length >= 0 and world_size >= 1, got {length}, {world_size}")
    base, extra = divmod(length, world_size)
    bounds, start = [], 0
    for i in range(world_size):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def ring_schedule(rank: int, world_size: int, phase: str, step: int) -> tuple[int, int]:
    """Which chunk `rank` sends to rank+1 and which it receives from rank-1 at `step` of `phase`.

    Args:
        phase: "reduce_scatter" (received chunk is added) or "all_gather" (received chunk is copied).
        step: 0 .. world_size-2.

    Returns:
        (send_chunk, recv_chunk), chunk indices in 0 .. world_size-1. What rank r sends at a step is exactly
        what rank r+1 receives at that step, so both sides agree on the chunk's size without talking.
    """
    if phase == "reduce_scatter":
        return (rank - step) % world_size, (rank - step - 1) % world_size
    if phase == "all_gather":
        return (rank + 1 - step) % world_size, (rank - step) % world_size
    raise ValueError(f"phase must be 'reduce_scatter' or 'all_gather', got {phase!r}")


@dataclass
class RingStats:
    """What one rank did in `ring_all_reduce`.

    Attributes:
        messages_sent: non-empty chunks sent (2(n-1) when every chunk is non-empty).
        bytes_sent: bytes this rank put on the wire; 2(n-1)/n * tensor bytes when n divides the length.
    """

    messages_sent: int = 0
    bytes_sent: int = 0


def ring_all_reduce(tensor: torch.Tensor, group=None, stats: RingStats | None = None) -> torch.Tensor:
    """Sum `tensor` over all ranks of `group` in place with a ring of isend/irecv; returns `tensor`.

    Works for any 1-D or N-D contiguous tensor (it is viewed as 1-D), any length (chunks need not be equal,
    and may be empty when the length is smaller than the world size), and any world size (1: nothing to do).
    Every rank must call it with a tensor of the same shape and dtype.

    Each step posts the send to rank+1 and the receive from rank-1 together (`dist.batch_isend_irecv` of an
    isend and an irecv, https://pytorch.org/docs/stable/distributed.html#point-to-point-communication) and
    waits for both: with
    blocking send/recv every rank would first send and nobody would receive (a deadlock on rendezvous-style
    transports). Waits are bounded by the process group's timeout.

    Args:
        tensor: this rank's contribution, overwritten with the sum; e.g. shape (L,), float32.
        group: the process group (default: the world).
        stats: if given, counts the messages and bytes this rank sent.

    Raises:
        ValueError: tensor is not contiguous.
        RuntimeError: a peer fails or the timeout passes (from torch.distributed).
    """
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce needs a contiguous tensor (it works on a flat view)")
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    flat = tensor.view(-1)
    bounds = chunk_bounds(flat.numel(), n)
    right = dist.get_global_rank(group, (rank + 1) % n) if group is not None else (rank + 1) % n
    left = dist.get_global_rank(group, (rank - 1) % n) if group is not None else (rank - 1) % n
    for phase in ("reduce_scatter", "all_gather"):
        for step in range(n - 1):
            send_c, recv_c = ring_schedule(rank, n, phase, step)
            s0, s1 = bounds[send_c]
            r0, r1 = bounds[recv_c]
            # The send buffer is a clone: this step's receive may write into another chunk of `flat`, but
            # the send must carry the values as they were at the start of the step.
            send_buf = flat[s0:s1].clone()
            recv_buf = torch.empty(r1 - r0, dtype=flat.dtype, device=flat.device)
            # Post the send and the receive together: with NCCL a lone send to a peer may wait for that peer's
            # receive, and with 2 ranks both would be sending first (a cycle); batch_isend_irecv groups them.
            ops = []
            if s1 > s0:
                ops.append(dist.P2POp(dist.isend, send_buf, right, group=group))
                if stats is not None:
                    stats.messages_sent += 1
                    stats.bytes_sent += send_buf.numel() * send_buf.element_size()
            if r1 > r0:
                ops.append(dist.P2POp(dist.irecv, recv_buf, left, group=group))
            for w in dist.batch_isend_irecv(ops) if ops else []:
                w.wait()
            if r1 > r0:
                if phase == "reduce_scatter":
                    flat[r0:r1] += recv_buf
                else:
                    flat[r0:r1] = recv_buf
    return tensor


def simulate_ring_all_reduce(tensors: Sequence[torch.Tensor],
                             snapshots: list | None = None) -> tuple[list[torch.Tensor], list[dict]]:
    """Run the ring all-reduce for len(tensors) simulated ranks in one process (no process group).

    Uses the same `ring_schedule` and `chunk_bounds` as `ring_all_reduce`. All sends of a step read the
    buffers as they were at the start of the step, as the real processes do.

    Args:
        tensors: tensors[r] is rank r's contribution; all of the same shape.
        snapshots: if given, after every step (phase, step, [buffer of each rank, flat]) is appended to it
            (the notebook draws these).

    Returns:
        (results, log): results[r] is rank r's buffer at the end (each should equal sum(tensors));
        log has one dict per message: phase, step, src, dst, chunk, start, end (element range).
    """
    n = len(tensors)
    bufs = [t.detach().clone().reshape(-1) for t in tensors]
    bounds = chunk_bounds(bufs[0].numel(), n)
    log: list[dict] = []
    for phase in ("reduce_scatter", "all_gather"):
        for step in range(n - 1):
            sent = []
            for r in range(n):
                c, _ = ring_schedule(r, n, phase, step)
                s0, s1 = bounds[c]
                sent.append((c, bufs[r][s0:s1].clone()))
                log.append({"phase": phase, "step": step, "src": r, "dst": (r + 1) % n, "chunk": c,
                            "start": s0, "end": s1})
            for r in range(n):
                c, payload = sent[(r - 1) % n]  # what rank r-1 sent to rank r
                assert c == ring_schedule(r, n, phase, step)[1]
                s0, s1 = bounds[c]
                if phase == "reduce_scatter":
                    bufs[r][s0:s1] += payload
                else:
                    bufs[r][s0:s1] = payload
            if snapshots is not None:
                snapshots.append((phase, step, [b.clone() for b in bufs]))
    return [b.reshape(tensors[0].shape) for b in bufs], log


def bus_bandwidth_factor(op: str, world_size: int) -> float:
    """busbw / algbw for a collective on `world_size` ranks, as nccl-tests defines it.

    all_reduce: 2(n-1)/n; reduce_scatter, all_gather: (n-1)/n; broadcast, reduce: 1
    (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md). 0 for n = 1: nothing moves.

    Raises:
        ValueError: unknown op or world_size < 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = world_size
    factors = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n,
               "broadcast": 1.0, "reduce": 1.0}
    if op not in factors:
        raise ValueError(f"unknown op {op!r}; one of {sorted(factors)}")
    return factors[op] if n > 1 else 0.0


def bandwidths(size_bytes: int, seconds: float, world_size: int, op: str = "all_reduce") -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s) for one call moving `size_bytes` per rank in `seconds`.

    algbw = size / time (what the caller sees); busbw = algbw * bus_bandwidth_factor(op, n) (what each link
    carries, comparable across world sizes).

    Raises:
        ValueError: seconds <= 0 or size_bytes < 0.
    """
    if seconds <= 0 or size_bytes < 0:
        raise ValueError(f"need seconds > 0 and size_bytes >= 0, got {seconds}, {size_bytes}")
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * bus_bandwidth_factor(op, world_size)


def time_op(fn: Callable[[], object], iters: int, warmup: int, device: torch.device,
            distributed: bool) -> float:
    """Mean seconds per call of `fn` over `iters` calls after `warmup` calls, the max over ranks.

    A barrier lines the ranks up before the clock starts; on CUDA the device is synchronised before each
    clock read (kernels are asynchronous). The slowest rank's time is returned (all-reduced with MAX), since
    a collective is finished only when every rank has its result. Every rank returns the same number.
    """
    for _ in range(warmup):
        fn()
    if distributed:
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    per_call = torch.tensor((time.perf_counter() - t0) / max(iters, 1), dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
    return per_call.item()
