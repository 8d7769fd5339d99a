"""Lesson 02: collectives -- a process group, every collective checked, a ring all-reduce from send/recv,
no server.

    python lessons/02_collectives.py                                    # one process, no process group
    torchrun --standalone --nproc_per_node=2 lessons/02_collectives.py  # 2 processes (2 GPUs or 2 CPU ones)
    torchrun --standalone --nproc_per_node=4 lessons/02_collectives.py  # also counts ring vs server, n = 4
    torchrun --standalone --nproc_per_node=1 lessons/02_collectives.py  # a world of one
    # the same on each of 2 nodes: a world of 4
    torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=$HOST0:29500 \\
        --rdzv-id=lessons lessons/02_collectives.py
    # algbw / busbw per message size
    torchrun --standalone --nproc_per_node=2 benchmarks/allreduce_bandwidth.py

What to look for (a measured line ends with "[claim <relation> <bound>: holds]"):
- RANK is global (0 .. WORLD_SIZE-1), LOCAL_RANK counts the processes of one node. The backend table (PyTorch
  docs): NCCL moves CUDA tensors only, gloo CPU tensors (and some CUDA ops), MPI exists only in builds from
  source. Then send/recv and 6 collectives run (the table's but gather, scatter, all_to_all), each checked
  locally.
- barrier: the last rank arrives 50 ms late; after the barrier every rank reads, in torchrun's key-value
  store, how many ranks had arrived: all of them. No clocks are compared across ranks (two nodes have two
  clocks).
- The ring all-reduce from isend/irecv equals dist.all_reduce (bit for bit on integer data) on lengths that do
  not divide by the world size. Each rank sends 2(n-1)/n of the tensor: nccl-tests' busbw / algbw factor.
- Ring versus parameter server, like with like (in + out on the busiest link): the server's link carries
  2(n-1) Psi, a ring rank's 4(n-1) Psi / n: n/2 times less, equal at n = 2. Formula for n = 2, 4, 8; bytes
  counted for n = 2 (and 4 with 4 processes).
- No parameter server: ONE all_reduce averages the shards' gradients, every rank steps its own optimizer:
  equal to one process on the global batch (~1e-8), replicas identical (difference 0). That settles two myths
  (README), "rank 0 gathers the gradients and broadcasts the weights" and "data parallelism syncs through a
  parameter server".
- Myth "ring all-reduce is what DDP does": DDP hands buckets to the backend's all_reduce, and NCCL chooses
  ring or tree algorithms by size and topology (GPU-only, not checked here: NCCL_ALGO in
  https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html). The ring is the model of the bandwidth
  cost.
Docs: https://pytorch.org/docs/stable/distributed.html,
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md (algbw, busbw)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.collectives.backends import backend_table
from common.collectives.checks import busiest_link, ring_vs_all_reduce, run_collectives
from common.collectives.ring import (
    LinkStats,
    parameter_server_all_reduce,
    ring_all_reduce,
    ring_link_bytes,
    server_link_bytes,
    simulation_equals_sum,
)
from common.data import digits_split
from common.harness.env import DistInfo, LessonError, read_torchrun_env
from common.harness.ranks import gather_to_rank0, max_param_diff_across_ranks, print0
from common.harness.results import Report
from common.harness.session import (
    add_distributed_args,
    barrier,
    distributed_session,
    run_main,
    set_seed,
)
from common.measure.bandwidth import bus_bandwidth_factor
from common.measure.counters import count_collectives
from common.measure.differences import max_abs_diff, max_over_ranks, nan_max
from common.models import mlp

PSI = 1024  # float32 elements in the ring-versus-server count: 4096 bytes, divisible by 2, 4 and 8 ranks


@dataclass
class Run:
    """What the sections share: the options, this rank, the report."""

    args: argparse.Namespace
    info: DistInfo
    report: Report


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[1, 3, 7, 1001],
        help="tensor lengths (elements) on which ring all-reduce is compared with dist.all_reduce",
    )
    p.add_argument("--batch-size", type=int, default=16, help="samples per process in the SGD step")
    p.add_argument(
        "--lr", type=float, default=0.1, help="SGD learning rate of that step (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=None, help="rank 0 writes the reported numbers here (JSON)")
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validate before any process group exists: every rank sees the same argv, so every rank fails alike.
    if min(args.lengths) < 1:
        raise LessonError(f"--lengths must be positive (elements), got {min(args.lengths)}")
    if args.lr <= 0:
        raise LessonError(f"--lr must be positive, got {args.lr}")
    world_size = read_torchrun_env()[2]
    if not 1 <= args.batch_size * world_size <= 1438:  # 1438 = digits training images
        raise LessonError(
            f"--batch-size x world_size must be in 1..1438 (the digits training set), got "
            f"{args.batch_size} x {world_size}"
        )
    return args


def average_gradients(model: torch.nn.Module, world_size: int, distributed: bool) -> torch.Tensor:
    """Replace each trainable parameter's gradient by its mean over the ranks, with ONE all_reduce; returns
    the flat buffer of averaged gradients. Frozen parameters (requires_grad=False, as in fine-tuning) have no
    gradient: skipped, as DDP skips them, and torch.optim then leaves them untouched. A parameter shared by
    two layers (tied) appears once in model.parameters(), its .grad already the sum of both uses."""
    params = [p for p in model.parameters() if p.requires_grad]
    # one flat buffer of all gradients (DDP does the same per bucket, overlapped with backward)
    grads = torch.cat([p.grad.reshape(-1) for p in params])
    if distributed:
        dist.all_reduce(grads, op=dist.ReduceOp.SUM)  # the only communication of the step
    grads /= world_size  # equal shard sizes: the mean of the shard means is the global-batch mean
    offset = 0
    for p in params:
        p.grad.copy_(grads[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return grads


def one_sgd_step(info, args) -> dict:
    """One data-parallel SGD step by hand: shard gradient -> one all_reduce -> divide -> own step."""
    n, r, dev, b = info.world_size, info.rank, info.device, args.batch_size
    train_set, _ = digits_split()  # every rank loads the same data; no rank distributes it
    x_global = (
        train_set.tensors[0][: b * n].reshape(b * n, -1).to(dev)
    )  # (b*n, 64): 8x8 images, flat
    y_global = train_set.tensors[1][: b * n].to(dev)  # (b*n,)
    x = x_global[r * b : (r + 1) * b]  # this rank's shard: (b, 64)
    y = y_global[r * b : (r + 1) * b]  # (b,)
    set_seed(args.seed)  # same seed -> same initial weights on every rank, nothing is broadcast
    model = mlp([64, 32, 10]).to(dev)
    set_seed(args.seed)
    reference = mlp([64, 32, 10]).to(dev)  # the one-process model that sees the global batch
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=args.lr) for m in (model, reference))
    with count_collectives() as calls:
        F.cross_entropy(model(x), y).backward()  # mean over this rank's b samples
        grads = average_gradients(model, n, info.distributed)  # (P,) P = 64*32+32+32*10+10 = 2410
        opt.step()  # every rank steps its own optimizer with the same gradient
    F.cross_entropy(
        reference(x_global), y_global
    ).backward()  # mean over all b*n samples, one process
    ref_opt.step()
    ref_grads = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    rank0_grads = grads.clone()
    if info.distributed:
        dist.broadcast(rank0_grads, src=0)  # for the CHECK only; training never needs it
    mine = [
        max_abs_diff(grads, rank0_grads),
        max_abs_diff(grads, ref_grads),
        nan_max(max_abs_diff(p, q) for p, q in zip(model.parameters(), reference.parameters())),
    ]
    worst = [max_over_ranks(e) for e in mine]  # the worst rank's (NaN-safe: gloo's MAX drops a NaN)
    return {
        "calls": calls.total,
        "all_reduces": calls.calls.get("all_reduce", 0),
        "num_params": grads.numel(),
        **dict(zip(("grad_across", "grad_vs_global", "param_vs_global"), worst)),
        "param_across": max_param_diff_across_ranks(model, info),
    }


def who_am_i(run: Run) -> None:
    """1. Per-rank facts travel to rank 0 and are printed there in rank order."""
    header = "rank local_rank world_size local_world_size device"
    keys = header.split()  # the facts, each printed as wide as its name
    mine = {k: getattr(run.info, k) for k in keys} | {"device": str(run.info.device)}
    facts = gather_to_rank0(mine, run.info) or []
    rows = [" ".join(f"{f[k]:>{len(k)}}" for k in keys) for f in facts]
    run.report.value("ranks", facts, "{header}\n{rows}", header=header, rows="\n".join(rows))
    if run.info.master_process:
        run.report.claim(
            "ranks_are_0_to_n_minus_1",
            [f["rank"] for f in facts] == list(range(run.info.world_size)),
            "==",
            True,
            "every rank 0 .. world_size-1 joined once: {value}",
        )


def backends(run: Run) -> None:
    """2. The docs' table of backends, and what this build of torch contains."""
    built = {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }
    run.report.record("backends_built", built)
    print0(
        "\nbackend support for these collectives (PyTorch docs; yes/no/?) -- and what this build of "
        "torch contains"
    )
    print0("\n".join(backend_table(built)))
    text = "gloo is in this build (CPU tensors need it): {value}"
    run.report.claim("gloo_built", built["gloo"], "==", True, text)


def check_collectives(run: Run) -> None:
    """3. Every collective, checked on every rank against the answer computed locally."""
    n = run.info.world_size
    if not run.info.distributed:
        print0(
            "\n(plain python: no process group, no collectives; "
            "torchrun --nproc_per_node=1: a world of one)"
        )
        return
    alone = "  (send/recv need a peer: skipped in a world of one)" if n == 1 else ""
    print0(
        f"\ncollectives on {run.info.backend}/{run.info.device.type}: rank k contributes "
        f"x_k = [0 1 2 3] + 100 k{alone}"
    )
    err, waited = run_collectives(run.info)
    worst = [max_over_ranks(e) for e in err.values()]  # the worst rank's, for every check, NaN-safe
    for check, e in zip(err, worst):
        if check == "barrier_missed_arrivals":
            run.report.claim(
                check,
                e,
                "==",
                0,
                "  barrier: arrivals missing when a rank left it {value:g} "
                "(the last rank came 50 ms late)",
            )
        elif check != "reduce_scatter_fallback":
            run.report.claim(
                f"{check}_exact",
                e,
                "==",
                0.0,
                "  {check:<24} max |error| over ranks {value:.1e}",
                check=check,
            )
        # native on both in torch 2.13; not on MPI (docs table)
        elif run.info.backend in ("gloo", "nccl"):
            run.report.claim(
                "reduce_scatter_native",
                e == 0,
                "==",
                True,
                "  reduce_scatter runs natively on {backend}: {value}",
                backend=run.info.backend,
            )
    run.report.perf(
        "barrier_wait_ms",
        gather_to_rank0(round(waited * 1e3, 1), run.info),
        "  barrier: each rank's own wait in it, ms {value}",
    )


def check_ring(run: Run) -> None:
    """4. The ring all-reduce from send/recv: simulated in this process, then between the processes."""
    n = run.info.world_size
    same = simulation_equals_sum(range(1, 5), run.args.lengths, run.args.seed)
    run.report.claim(
        "ring_simulation_equals_sum",
        same,
        "==",
        1,
        "\nring schedule simulated for 1..4 ranks, lengths {lengths}: equals the plain sum: {value}",
        lengths=run.args.lengths,
    )
    if not run.info.distributed:
        return
    # integers in float32 sum exactly; random floats round
    rows = [ring_vs_all_reduce(run.info, length, run.args.seed) for length in run.args.lengths]
    row = "  length {length:>6}  integer data max |diff| {int_diff:.1e}  "
    row += "float data max |diff| {float_diff:.1e}"
    run.report.value(
        "ring_vs_all_reduce",
        rows,
        "ring all-reduce (isend/irecv) vs dist.all_reduce on {n} ranks:\n{lines}",
        n=n,
        lines="\n".join(row.format(**r) for r in rows),
    )
    run.report.claim(
        "ring_equals_all_reduce_on_integers",
        nan_max(r["int_diff"] for r in rows),
        "==",
        0.0,
        "  ring == dist.all_reduce on integer data, every length: max |diff| {value:.1e}",
    )
    run.report.claim(
        "ring_close_to_all_reduce_on_floats",
        nan_max(r["float_diff"] for r in rows),
        "<=",
        1e-4,
        "  on float data (another summation order): max |diff| {value:.1e}",
    )
    ring_traffic(run)


def ring_traffic(run: Run) -> None:
    """4, continued: the messages and bytes one rank of the ring sends, counted."""
    n = run.info.world_size
    stats = LinkStats()
    # n divides the length
    ring_all_reduce(torch.ones(1024 * n, device=run.info.device), stats=stats)
    run.report.claim(
        "ring_messages_per_rank",
        stats.messages_sent,
        "==",
        2 * (n - 1),
        "  one all-reduce of {elements} float32: messages each rank sends {value} = 2(n-1)",
        elements=1024 * n,
    )
    print0(
        "  nccl-tests' algbw = bytes / time; busbw = algbw x the share of the tensor each rank sends:"
    )
    run.report.claim(
        "ring_bytes_sent_share",
        stats.bytes_sent / (1024 * n * 4),
        "==",
        bus_bandwidth_factor("all_reduce", n),
        "  bytes each rank sends {sent} = {value:.4f} x the tensor = 2(n-1)/n, nccl-tests' busbw / algbw",
        sent=stats.bytes_sent,
    )


def ring_vs_server(run: Run) -> None:
    """5. Ring versus parameter server: bytes on the busiest link, in + out (formula; counted if m <= n)."""
    print0(
        f"\nbusiest link, in + out, all-reducing Psi = {PSI * 4} bytes: server 2(n-1) Psi, "
        "ring 4(n-1) Psi / n"
    )
    for m in (2, 4, 8):
        server, ring = server_link_bytes(m, 4 * PSI), ring_link_bytes(m, 4 * PSI)
        run.report.claim(
            f"server_over_ring_formula_n{m}",
            server / ring,
            "==",
            m / 2,
            "  n = {m} (formula): server {server}, ring {ring:.0f}, server / ring {value:g} = n/2",
            m=m,
            server=server,
            ring=ring,
        )
    for m in [m for m in (2, 4, 8) if m <= run.info.world_size]:
        # every rank creates every group
        group = dist.new_group(list(range(m))) if m < run.info.world_size else None
        ring = busiest_link(run.info, ring_all_reduce, m, group, PSI)
        server = busiest_link(run.info, parameter_server_all_reduce, m, group, PSI)
        run.report.claim(
            f"ring_link_bytes_measured_n{m}",
            ring,
            "==",
            ring_link_bytes(m, 4 * PSI),
            "  n = {m} (counted): ring {value:.0f} = 4(n-1) Psi / n",
            m=m,
        )
        run.report.claim(
            f"server_link_bytes_measured_n{m}",
            server,
            "==",
            server_link_bytes(m, 4 * PSI),
            "  n = {m} (counted): server {value:.0f} = 2(n-1) Psi, {ratio:g} x the ring's",
            m=m,
            ratio=server / ring,
        )


def no_parameter_server(run: Run) -> None:
    """6. No parameter server: one all_reduce of the gradient, every rank steps itself (= one process on
    the global batch)."""
    s = one_sgd_step(run.info, run.args)
    print0(
        f"\none SGD step, global batch {run.info.world_size} x {run.args.batch_size} samples, "
        f"{s['num_params']} parameters:"
    )
    run.report.claim(
        "step_collectives",
        s["calls"],
        "==",
        int(run.info.distributed),
        "  collectives in the step {value}: {all_reduces} all_reduce of the gradient; "
        "no broadcast of weights",
        all_reduces=s["all_reduces"],
    )
    run.report.claim(
        "grad_same_on_every_rank",
        s["grad_across"],
        "==",
        0.0,
        "  averaged gradient, max |diff| across ranks:           {value:.1e}",
    )
    run.report.claim(
        "grad_equals_global_batch",
        s["grad_vs_global"],
        "<=",
        1e-6,  # float32, another sum order
        "  averaged gradient vs one process on the global batch: {value:.1e}",
    )
    run.report.claim(
        "params_same_on_every_rank",
        s["param_across"],
        "==",
        0.0,  # same start, gradient, update
        "  parameters after the step, max |diff| across ranks:   {value:.1e}",
    )
    run.report.claim(
        "params_equal_global_batch",
        s["param_vs_global"],
        "<=",
        1e-6,
        "  parameters vs one process on the global batch:        {value:.1e}",
    )


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        report = Report(info)
        report.record("backend", info.backend)
        report.record("device", info.device.type)
        report.record("distributed", info.distributed)
        report.value(
            "world_size",
            info.world_size,
            "world_size {value}  backend {backend}  device {device}",
            backend=info.backend or "none (plain python)",
            device=info.device.type,
        )
        run = Run(args, info, report)
        who_am_i(run)
        check_collectives(run)
        backends(run)  # after the collectives it tabulates
        check_ring(run)
        ring_vs_server(run)
        no_parameter_server(run)
        report.finish(args.results)
        # every message received before teardown: 1 in 30 4-rank gloo runs aborted without it
        barrier(info)


if __name__ == "__main__":
    run_main(main)
