"""Step time of DDP, ZeRO stages 1-3 by hand and FSDP2 next to the bytes each sends, and the largest model each fits
in a fixed per-rank memory budget (lesson 13).

    torchrun --standalone --nproc_per_node=2 benchmarks/sharding_speed.py
    torchrun --standalone --nproc_per_node=4 benchmarks/sharding_speed.py --width 512 --budget-mb 8

1. Speed: one Adam step on --global-batch samples of lesson 08's ResidualMLP (--width, --depth), each setup; the
   median step time over --repeats steps after one warm-up, the slowest rank's, as a ratio to DDP's from the same
   run; next to it the bytes each rank sent per step (counted, lesson 13). Times are `[perf]` lines.
2. Capacity: bytes per parameter a rank holds with Adam in fp32 (parameters 4, gradients 4, Adam state 8):
   DDP 16 (gradient_as_bucket_view: the buckets are the gradients), stage 1 8 + 8/N, stage 2 4 + 12/N, stage 3
   16/N. The widest ResidualMLP of --depth blocks whose parameters, gradients at the end of backward and Adam
   state fit --budget-mb is computed from those counts (one unit wider would not fit), then built and trained
   for one step to confirm that the measured bytes fit. Activations and stage 3's one gathered unit at a
   time come on top: lesson 08 measures activations; the budget here is what sharding divides.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from common.data import digits_split, global_batch_slices
from common.harness.env import LessonError
from common.harness.grid import Grid
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main, set_seed
from common.measure.bandwidth import ring_bytes_sent
from common.measure.counters import count_collectives
from common.measure.memory import held_bytes
from common.models import ResidualMLP
from common.sharding.accounting import moved_bytes
from common.sharding.fsdp import shard_blocks_then_root
from common.sharding.zero import ZeRO, flat_units

lesson = importlib.import_module("lessons.13_sharded_data_parallel")
SETUPS = ("DDP", "stage 1", "stage 2", "stage 3", "FSDP2")


def bytes_per_param(setup: str, n: int) -> float:
    """Bytes a rank holds per parameter (fp32 parameters, gradients, Adam's two moments), padding aside."""
    return {
        "DDP": 16,
        "stage 1": 8 + 8 / n,
        "stage 2": 4 + 12 / n,
        "stage 3": 16 / n,
        "FSDP2": 16 / n,
    }[setup]


def n_params(width: int, depth: int) -> int:
    return (
        64 * width + width + depth * 2 * (width * width + width) + 10 * width + 10
    )  # stem, blocks, head


def build(setup: str, width: int, depth: int, grid: Grid, info, lr: float = 1e-3):
    """(model to call, step function, optimizer) for one setup."""
    raw = ResidualMLP(width, depth).to(info.device)
    if setup == "DDP":
        opt = torch.optim.Adam(raw.parameters(), lr=lr)
        model = DDP(
            raw,
            gradient_as_bucket_view=True,
            device_ids=[info.local_rank] if info.device.type == "cuda" else None,
        )
        return (
            model,
            opt.step,
            opt,
            list(raw.parameters()),
            lambda: [p.grad for p in raw.parameters()],
        )
    if setup == "FSDP2":
        model = shard_blocks_then_root(raw, grid.submesh("dp"), reshard_after_forward=True)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        return (
            model,
            opt.step,
            opt,
            list(model.parameters()),
            lambda: [p.grad for p in model.parameters()],
        )
    zero = ZeRO(raw, [u for _, u in flat_units(raw)], int(setup[-1]), group=grid.group("dp"), lr=lr)
    return (
        raw,
        zero.step,
        zero.optimizer,
        [*raw.parameters(), *(u.shard for u in zero.units)],
        lambda: [*(p.grad for p in raw.parameters()), *(u.shard.grad for u in zero.units)],
    )


def sync(info) -> None:
    if (
        info.device.type == "cuda"
    ):  # kernels run asynchronously: wait for them before reading the clock
        torch.cuda.synchronize()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=256, help="samples per step over all ranks")
    p.add_argument("--repeats", type=int, default=10, help="timed steps per setup (median)")
    p.add_argument(
        "--budget-mb",
        type=float,
        default=4.0,
        help="per-rank bytes for parameters, gradients, Adam",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=None, help="rank 0 writes the table here as JSON")
    add_distributed_args(p)
    args = p.parse_args()
    if min(args.width, args.depth, args.repeats, args.global_batch) < 1 or args.budget_mb <= 0:
        raise LessonError(
            "--width, --depth, --repeats, --global-batch and --budget-mb must be positive"
        )
    return args


def speed(args, info, grid: Grid, data: list) -> dict:
    """Part 1: each setup's median step time (the slowest rank's) and the bytes a rank sends per step."""
    N, rows = info.world_size, {}
    for setup in SETUPS:
        model, step, _, _, _ = build(setup, args.width, args.depth, grid, info)
        lesson.train(model, step, data[:1])  # warm-up: DDP's buckets, FSDP2's lazy init
        times = []
        with count_collectives() as c:
            for batch in data[1:]:
                sync(info)
                t0 = time.perf_counter()
                lesson.train(model, step, [batch])
                sync(info)
                times.append(time.perf_counter() - t0)
        slowest = torch.tensor(statistics.median(times), device=info.device)
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
        sent = moved_bytes(c.bytes, N) / args.repeats
        if setup == "DDP":  # DDP's all-reduce runs in C++: 2 Psi (N-1)/N from its parameters
            sent = ring_bytes_sent("all_reduce", 4 * n_params(args.width, args.depth), N)
        rows[setup] = {"step_s": slowest.item(), "bytes_sent": sent}
    return rows


def capacity(args, info, grid: Grid, data: list) -> dict:
    """Part 2: the widest model whose bytes per rank fit the budget, from the counts; built, trained one
    step and measured."""
    budget, widest = args.budget_mb * 2**20, {}
    for setup in SETUPS:
        w = 1
        while n_params(w + 1, args.depth) * bytes_per_param(setup, info.world_size) <= budget:
            w += 1
        model, step, opt, params, grads = build(setup, w, args.depth, grid, info)
        _, grad_bytes = lesson.train(model, step, data[:1], grads)
        measured = sum(held_bytes(params, [], opt).values()) + grad_bytes
        widest[setup] = {
            "width": w,
            "n_params": n_params(w, args.depth),
            "measured_bytes": measured,
        }
    return widest


def report_speed(report: Report, args, N: int, rows: dict) -> None:
    report.record("speed", rows)
    report.value(
        "width",
        args.width,
        "1. ResidualMLP width {value} depth {depth} ({n} parameters), {N} ranks, global batch {B}",
        depth=args.depth,
        n=n_params(args.width, args.depth),
        N=N,
        B=args.global_batch,
    )
    for setup, row in rows.items():
        report.perf(
            f"step_ratio_{setup.replace(' ', '')}",
            row["step_s"] / rows["DDP"]["step_s"],
            "{setup:<8} step {ms:7.2f} ms = {value:.2f}x DDP's; sent {mb:.3f} MB per rank per step",
            setup=setup,
            ms=row["step_s"] * 1e3,
            mb=row["bytes_sent"] / 1e6,
        )


def report_capacity(report: Report, args, N: int, widest: dict) -> None:
    report.record("capacity", widest)
    report.value(
        "budget_mb",
        args.budget_mb,
        "2. widest model in {value} MB per rank (parameters, gradients at the end of backward,"
        " Adam state), depth {depth}, {N} ranks:\n{rows}",
        depth=args.depth,
        N=N,
        rows="\n".join(
            f"  {s:<8} width {r['width']:>4}: {r['n_params']:>9} parameters "
            f"({r['n_params'] / widest['DDP']['n_params']:.2f}x DDP's), measured "
            f"{r['measured_bytes'] / 2**20:.3f} MB"
            for s, r in widest.items()
        ),
    )
    # + 1%: padding, step counters
    fits = all(r["measured_bytes"] <= args.budget_mb * 2**20 * 1.01 for r in widest.values())
    report.claim(
        "every_widest_model_fits",
        int(fits),
        "==",
        1,
        "  each measured within the budget (+1%): {value}",
    )


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        if not info.distributed:
            raise LessonError(
                "run it under torchrun (FSDP2 needs a process group): "
                "torchrun --standalone --nproc_per_node=2 benchmarks/sharding_speed.py"
            )
        N, report, grid = info.world_size, Report(info), Grid(info, dp=info.world_size)
        if args.global_batch % N:
            raise LessonError(f"--global-batch {args.global_batch} cannot be split over {N} ranks")
        set_seed(args.seed)
        train_set, _ = digits_split()
        data = global_batch_slices(
            train_set,
            args.repeats + 1,
            args.global_batch,
            args.seed,
            info.rank,
            N,
            device=info.device,
        )
        rows = speed(args, info, grid, data)
        report_speed(report, args, N, rows)
        widest = capacity(args, info, grid, data)
        report_capacity(report, args, N, widest)
        report.write(args.results)


if __name__ == "__main__":
    run_main(main)
