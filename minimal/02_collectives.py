"""Minimal 02: collectives -- a process group, four collectives, a ring all-reduce from send/recv.

    torchrun --standalone --nproc_per_node=2 minimal/02_collectives.py
    torchrun --standalone --nproc_per_node=4 minimal/02_collectives.py
    python minimal/02_collectives.py                                # plain python: a world of one

Every rank runs this same file; RANK (0 .. WORLD_SIZE-1) tells them apart. Rank k contributes
x_k = [0, 1, 2, 3] + 100 k. A collective is called by EVERY rank; rank 0 prints what it received.
The ring: reduce-scatter then all-gather, each rank talking only to its neighbours; every rank sends
2(n-1)/n of the tensor. The check: the ring equals dist.all_reduce. Lesson: lessons/02.
"""

import argparse
import os

import torch
import torch.distributed as dist


def ring_all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum the 1-D `t` over all ranks, in place, with messages to rank+1 and from rank-1 only."""
    n, rank = dist.get_world_size(), dist.get_rank()
    chunks = t.tensor_split(n)  # n views whose lengths differ by at most one (length >= n here)
    for step in range(2 * (n - 1)):  # n-1 steps of reduce-scatter, then n-1 of all-gather
        send, recv = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        buf = torch.empty_like(recv)
        # post the send and the receive together: if every rank sent first, all could wait forever
        ops = [
            dist.P2POp(dist.isend, send, (rank + 1) % n),  # to the right neighbour
            dist.P2POp(dist.irecv, buf, (rank - 1) % n),  # from the left one
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if step < n - 1:
            recv += buf  # reduce-scatter: add the left neighbour's partial sum of this chunk
        else:
            recv.copy_(buf)  # all-gather: a finished chunk travels on around the ring
    return t  # after step n-2 rank r held the whole sum of chunk r+1; now every rank holds all


def run(args, rank, world_size, device) -> None:
    # --- the four collectives (each rank can compute every x_k, so each result is checkable) ---
    x = [torch.arange(4, dtype=torch.float32, device=device) + 100 * k for k in range(world_size)]
    got, want = {}, {}
    t = x[rank].clone()
    dist.broadcast(t, src=0)  # every rank ends with rank 0's tensor
    got["broadcast"], want["broadcast"] = t, x[0]
    t = x[rank].clone()
    dist.all_reduce(t)  # every rank ends with the sum (op=SUM by default)
    got["all_reduce"], want["all_reduce"] = t, sum(x)
    parts = [torch.empty(4, device=device) for _ in range(world_size)]
    dist.all_gather(parts, x[rank])  # every rank ends with every rank's tensor, in rank order
    got["all_gather"], want["all_gather"] = torch.stack(parts), torch.stack(x)
    t = torch.empty(4, device=device)
    inputs = [x[rank] + 1000 * j for j in range(world_size)]  # input j is meant for rank j
    dist.reduce_scatter(t, inputs)  # rank j ends with the sum over ranks of their inputs j
    got["reduce_scatter"], want["reduce_scatter"] = t, sum(x) + 1000 * rank * world_size
    if rank == 0:
        for name, value in got.items():
            print(f"{name:<15} rank 0 received {value.tolist()}")

    # --- the ring all-reduce, on integers (exact in any order of summation) and on floats ---
    g = torch.Generator().manual_seed(args.seed + rank)  # a different tensor on every rank
    for length in args.lengths:
        data = torch.randint(-1000, 1000, (length,), generator=g).float().to(device)
        got[f"ring_{length}"], want[f"ring_{length}"] = ring_all_reduce(data.clone()), data.clone()
        dist.all_reduce(want[f"ring_{length}"])  # PyTorch's own, the reference
        floats = torch.randn(length, generator=g).to(device)  # another summation order: last bits
        ring, reference = ring_all_reduce(floats.clone()), floats.clone()
        dist.all_reduce(reference)
        if rank == 0:
            print(
                f"ring vs dist.all_reduce, {length} floats: max |difference| "
                f"{(ring - reference).abs().max().item():.1e}"
            )

    # --- the check: every collective gave what we computed locally; the ring equals all_reduce ---
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # integers in float32: exact
    if rank == 0:
        print(f"all checks hold on {world_size} rank(s)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[7, 1001], help="ring tensor lengths")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    # --- setup: one process per device, started by torchrun (which sets RANK, WORLD_SIZE, ...) ---
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # the device on this node; RANK is global
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: NCCL binds this process to its GPU
    if min(args.lengths) < world_size:  # before init: every rank refuses alike
        raise SystemExit(f"--lengths must be >= the world size {world_size}")
    if "RANK" not in os.environ:  # plain python: what torchrun would set, for a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT="0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # reads those variables
    try:
        run(args, rank, world_size, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
