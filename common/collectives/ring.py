"""The ring all-reduce built from send/recv, its schedule, and what its links carry (lesson 02).

The ring all-reduce (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations",
JPDC 2009; the algorithm Baidu brought to deep learning in 2017) splits a tensor of S bytes into n chunks, one
per rank, and runs two phases of n-1 steps each on a ring rank -> rank+1:

    reduce-scatter  at step s rank r sends chunk (r - s) mod n to rank r+1, receives chunk (r - s - 1) mod n
                    from rank r-1 and ADDS it into its own copy. After n-1 steps rank r holds the complete
                    sum of chunk (r + 1) mod n.
    all-gather      at step s rank r sends chunk (r + 1 - s) mod n, receives chunk (r - s) mod n and
                    OVERWRITES its copy. After n-1 more steps every rank holds every summed chunk.

Each rank sends 2(n-1) chunks of about S/n bytes, 2(n-1)/n * S in all, and receives as much: its link carries
4(n-1)/n * S in + out. A parameter server's link carries 2(n-1) * S (n-1 gradients in, n-1 sums out), n/2 times
more (`ring_link_bytes`, `server_link_bytes`). nccl-tests' bus bandwidth uses the 2(n-1)/n factor
(`common.measure.bandwidth`).

The same `ring_schedule` drives the real implementation (`ring_all_reduce`, isend/irecv between processes) and
the in-process simulation (`simulate_ring_all_reduce`) that the notebook draws, so the picture shows the code.

DDP does not call this function: it hands gradient buckets to the backend's all_reduce, and NCCL chooses ring or
tree algorithms by message size and topology (GPU-only, not checked here; NCCL_ALGO in
https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html). The ring is the model for the bandwidth cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.measure.bandwidth import ring_bytes_sent

__all__ = [
    "chunk_bounds",
    "ring_schedule",
    "LinkStats",
    "ring_all_reduce",
    "simulate_ring_all_reduce",
    "simulation_equals_sum",
    "parameter_server_all_reduce",
    "ring_link_bytes",
    "server_link_bytes",
]


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
class LinkStats:
    """What one rank put on, and took off, its link (counted by `ring_all_reduce` and lesson 02's server).

    Attributes:
        messages_sent: non-empty messages sent (2(n-1) in a ring when every chunk is non-empty).
        bytes_sent: bytes sent; 2(n-1)/n * tensor bytes in a ring when n divides the length.
        bytes_received: bytes received; the same as sent in a ring.
    """

    messages_sent: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    @property
    def link_bytes(self) -> int:
        """In + out: what the rank's one link carries (a full-duplex link carries both at once)."""
        return self.bytes_sent + self.bytes_received


def ring_all_reduce(
    tensor: torch.Tensor, group=None, stats: LinkStats | None = None
) -> torch.Tensor:
    """Sum `tensor` over all ranks of `group` in place with a ring of isend/irecv; returns `tensor`.

    Works for any 1-D or N-D contiguous tensor (it is viewed as 1-D), any length (chunks need not be equal,
    and may be empty when the length is smaller than the world size), and any world size (1: nothing to do).
    Every rank of `group` must call it with a tensor of the same shape and dtype.

    Each step posts the send to rank+1 and the receive from rank-1 together (`dist.batch_isend_irecv`) and waits
    for both, bounded by the process group's timeout.

    Args:
        tensor: this rank's contribution, overwritten with the sum; e.g. shape (L,), float32.
        group: the process group (default: the world).
        stats: if given, counts the messages and bytes this rank sent and received.

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
            # Post the send and the receive together. With NCCL a lone send may wait for the peer's receive,
            # and with 2 ranks both would be sending first (a cycle) (GPU-only, not checked here; see the
            # torch.distributed.batch_isend_irecv docs). Empty chunks send nothing.
            ops = []
            if s1 > s0:
                ops.append(dist.P2POp(dist.isend, send_buf, right, group=group))
            if r1 > r0:
                ops.append(dist.P2POp(dist.irecv, recv_buf, left, group=group))
            for w in dist.batch_isend_irecv(ops) if ops else []:
                w.wait()
            if stats is not None:
                stats.messages_sent += int(s1 > s0)
                stats.bytes_sent += send_buf.numel() * send_buf.element_size()
                stats.bytes_received += recv_buf.numel() * recv_buf.element_size()
            if r1 > r0:
                if phase == "reduce_scatter":
                    flat[r0:r1] += recv_buf
                else:
                    flat[r0:r1] = recv_buf
    return tensor


def simulate_ring_all_reduce(
    tensors: Sequence[torch.Tensor], snapshots: list | None = None
) -> tuple[list[torch.Tensor], list[dict]]:
    """Run the ring all-reduce for len(tensors) simulated ranks in one process (no process group).

    Uses the same `ring_schedule` and `chunk_bounds` as `ring_all_reduce`. All sends of a step read the
    buffers as they were at the start of the step, as the real processes do.

    Args:
        tensors: tensors[r] is rank r's contribution; all of the same shape.
        snapshots: if given, after every step (phase, step, [buffer of each rank, flat]) is appended to it
            (the notebook draws these).

    Returns:
        (results, log): results[r] is rank r's buffer at the end (each should equal sum(tensors));
        log has one dict per message: phase, step, src, dst, chunk, start, end (element range), bytes.
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
                log.append(
                    {
                        "phase": phase,
                        "step": step,
                        "src": r,
                        "dst": (r + 1) % n,
                        "chunk": c,
                        "start": s0,
                        "end": s1,
                        "bytes": (s1 - s0) * bufs[r].element_size(),
                    }
                )
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


def simulation_equals_sum(
    world_sizes: Sequence[int], lengths: Sequence[int], seed: int = 0
) -> bool:
    """True when, for every world size and length, every simulated rank ends with the plain sum of random
    integer-valued float32 inputs (exact) and the log holds 2(n-1) steps x n messages."""
    g = torch.Generator().manual_seed(seed)
    ok = True
    for n in world_sizes:
        for length in lengths:
            inputs = [torch.randint(-1000, 1000, (length,), generator=g).float() for _ in range(n)]
            results, log = simulate_ring_all_reduce(inputs)
            ok &= (
                all(torch.equal(res, sum(inputs)) for res in results)
                and len(log) == 2 * (n - 1) * n
            )
    return bool(ok)


def parameter_server_all_reduce(
    tensor: torch.Tensor, group=None, stats: LinkStats | None = None
) -> torch.Tensor:
    """The design DDP does NOT use, for comparison: the group's first rank acts as the server, receives every
    rank's tensor, sums, and sends the sum back; returns `tensor`, overwritten with the sum on every rank.

    The server's link carries 2(n-1) * tensor bytes (`server_link_bytes`); every other link carries 2x the tensor.
    `stats` counts what this rank sent and received.
    """
    ranks = (
        dist.get_process_group_ranks(group)
        if group is not None
        else list(range(dist.get_world_size()))
    )
    nbytes, others = tensor.numel() * tensor.element_size(), len(ranks) - 1
    stats = stats if stats is not None else LinkStats()
    if dist.get_rank() == ranks[0]:
        buf = torch.empty_like(tensor)
        for src in ranks[1:]:  # n-1 tensors in ...
            dist.recv(buf, src=src, group=group)
            tensor += buf
        for dst in ranks[1:]:  # ... and n-1 sums out, all through this one rank's link
            dist.send(tensor, dst=dst, group=group)
        stats.bytes_received += others * nbytes
        stats.bytes_sent += others * nbytes
        stats.messages_sent += others
    else:
        dist.send(tensor, dst=ranks[0], group=group)
        dist.recv(tensor, src=ranks[0], group=group)
        stats.bytes_sent += nbytes
        stats.bytes_received += nbytes
        stats.messages_sent += 1
    return tensor


def ring_link_bytes(world_size: int, nbytes: int) -> float:
    """In + out on one ring rank's link for an all-reduce of `nbytes`: 2 * 2(n-1)/n * nbytes = 4(n-1)/n * nbytes."""
    return 2 * ring_bytes_sent("all_reduce", nbytes, world_size)


def server_link_bytes(world_size: int, nbytes: int) -> int:
    """In + out on a parameter server's link (the busiest) when one of n ranks serves the n-1 others:
    n-1 gradients in and n-1 results out, 2(n-1) * nbytes. `server / ring` = n/2: equal at n = 2."""
    return 2 * (world_size - 1) * nbytes
