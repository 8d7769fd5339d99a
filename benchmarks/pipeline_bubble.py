"""Pipeline speed-up with real compute: the hand-written GPipe (or 1F1B) of lesson 09 with m=1 against m=4.

    torchrun --standalone --nproc_per_node=2 benchmarks/pipeline_bubble.py
    torchrun --standalone --nproc_per_node=2 benchmarks/pipeline_bubble.py --width 1024 --batch 2048 --steps 5
    torchrun --standalone --nproc_per_node=2 benchmarks/pipeline_bubble.py --stage-ms 200   # the lesson's sleep

The model is 4 Linear(W, W) layers cut into one stage per rank (`Grid(info, pp=world_size)`); the batch is
random data. For p equal stages, theory says a step with m micro-batches takes (m+p-1)/m of the batch's
per-stage work, so m=4 against m=1 is 4p/(p+3) = 1.6x faster at p=2, and the bubble falls from (p-1)/p to
(p-1)/(p+3). On CPU every micro-batch also pays a send/recv and smaller, less efficient matrix products, so the
measured speed-up stays below theory (and can be below 1 for small W); with --stage-ms (a sleep per stage, as in
the lesson) compute dominates and the speed-up approaches theory. Lesson 09 has the bubble for every schedule;
this is the benchmark that is not its point. All numbers are timings: [perf] lines, medians over --steps.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.harness.env import LessonError, read_torchrun_env
from common.harness.grid import Grid
from common.harness.ranks import gather_to_rank0
from common.harness.results import Report
from common.harness.session import (
    add_distributed_args,
    barrier,
    distributed_session,
    run_main,
    set_seed,
)
from common.models import mlp
from common.pipeline.executor import run_pipeline_step
from common.pipeline.schedules import (
    default_split_points,
    microbatch_sizes,
    schedule_order,
    split_model,
    theory_bubble,
    theory_speedup,
)
from common.pipeline.stage_timers import SimulatedKernel, TimedStage, measured_bubble, record_step


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--width",
        type=int,
        default=768,
        help="W of the 4 Linear(W, W) layers (default %(default)s)",
    )
    p.add_argument(
        "--batch", type=int, default=128, help="samples per step, global (default %(default)s)"
    )
    p.add_argument(
        "--microbatches", type=int, nargs="+", default=[1, 4], help="values of m (default 1 4)"
    )
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    p.add_argument("--steps", type=int, default=3, help="timed steps per m, after one warm-up step")
    p.add_argument(
        "--stage-ms",
        type=float,
        default=0.0,
        help="simulated kernel per rank and batch, ms; 0 = off",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=None, help="rank 0 writes the numbers here as JSON")
    args = add_distributed_args(p).parse_args(argv)
    if args.width < 1 or args.steps < 1 or args.stage_ms < 0 or not args.microbatches:
        raise LessonError("--width and --steps must be >= 1, --stage-ms >= 0")
    if (
        world_size := read_torchrun_env()[2]
    ) > 4:  # before any process group: every rank fails alike
        raise LessonError(f"4 Linear layers make at most 4 stages, the world size is {world_size}")
    for m in args.microbatches:
        try:
            microbatch_sizes(args.batch, m)
        except ValueError as e:
            raise LessonError(f"--microbatches: {e}") from None
    return args


def time_microbatches(args, info, grid: Grid, stage, batch: tuple, m: int) -> list[dict] | None:
    """`--steps` pipelined steps of the batch (x, y) in m micro-batches under `--schedule`: each step's span
    and bubble, measured from every stage's events, on rank 0 (None elsewhere)."""
    p, pp_rank, (x, y) = grid.size("pp"), grid.coords["pp"], batch
    sizes, order = microbatch_sizes(args.batch, m), schedule_order(args.schedule, m, p, pp_rank)

    def step():
        stage.zero_grad(set_to_none=True)
        run_pipeline_step(
            stage,
            order,
            pp_rank=pp_rank,
            pp_world_size=p,
            sizes=sizes,
            recv_shape=(args.width,),
            stage_ranks=grid.ranks_in("pp"),
            inputs=list(x.split(sizes)),
            targets=list(y.split(sizes)),
            loss_fn=F.cross_entropy,
            device=info.device,
        )

    timings = []
    for i in range(args.steps):
        _, events = record_step(
            step, [stage], lambda: barrier(info), args.stage_ms / args.batch, warmup=i == 0
        )
        got = gather_to_rank0(events, info)
        if info.master_process:
            timings.append(measured_bubble(got))
    return timings if info.master_process else None


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        report = Report(info)
        grid = Grid(info, pp=info.world_size)
        p, pp_rank, W = grid.size("pp"), grid.coords["pp"], args.width
        set_seed(args.seed)  # every rank builds the same model and keeps its stage
        model = mlp([W] * 5)
        part = split_model(model, default_split_points(model, p))[pp_rank]
        stage = TimedStage(nn.Sequential(*part, SimulatedKernel(0.0))).to(info.device)
        g = torch.Generator().manual_seed(args.seed + 1)
        x, y = (
            torch.randn(args.batch, W, generator=g),
            torch.randint(0, W, (args.batch,), generator=g),
        )
        report.value(
            "config",
            {"width": W, "batch": args.batch, "stages": p, "schedule": args.schedule},
            "benchmark: {value[schedule]}, 4 x Linear({value[width]}, {value[width]}) in {value[stages]} "
            "stage(s), batch {value[batch]}, real compute"
            + (f" + {args.stage_ms} ms simulated per rank" if args.stage_ms else ""),
        )
        spans: dict[int, float] = {}
        for m in args.microbatches:
            timings = time_microbatches(args, info, grid, stage, (x, y), m)
            if info.master_process:
                spans[m] = statistics.median(t["span_s"] for t in timings)
                report.perf(
                    f"step_ms_m{m}",
                    1e3 * spans[m],
                    f"m={m}: step {{value:.1f}} ms, bubble "
                    f"{statistics.median(t['bubble'] for t in timings):.3f} (theory {theory_bubble(p, m):.3f})",
                )
        if info.master_process and 1 in spans and len(spans) > 1:
            m = max(spans)
            report.perf(
                f"speedup_m{m}",
                spans[1] / spans[m],
                f"speed-up of m={m} over m=1: {{value:.2f}} (theory {theory_speedup(p, m):.2f})",
            )
        report.write(args.results)


if __name__ == "__main__":
    run_main(main)
