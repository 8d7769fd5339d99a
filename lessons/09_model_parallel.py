"""Lesson 09: model parallelism -- a naive split, then pipelines (GPipe, 1F1B, interleaved 1F1B), by hand and
with torch.distributed.pipelining.

    python lessons/09_model_parallel.py                                     # naive split, a 1-stage pipeline
    torchrun --standalone --nproc_per_node=2 lessons/09_model_parallel.py   # 2 stages, one per rank
    torchrun --standalone --nproc_per_node=4 lessons/09_model_parallel.py --stage-ms 0 --batch-size 16
    torchrun --standalone --nproc_per_node=2 benchmarks/pipeline_bubble.py  # real compute: m=4 against m=1

What to look for:
- Naive split (one process): stage 0 then stage 1, on cuda:0 and cuda:1 with two GPUs, else both on the CPU
  ("simulated"); the activation moves at the boundary. Only one device works at a time (idle fraction ~0.5).
- Pipelines: `Grid(info, pp=world_size)` gives each rank its pp_rank and neighbours. Every schedule (GPipe,
  1F1B by hand; torch's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B), m = 1, 2, 4, 8: the unsplit
  model's loss, gradients and parameters after an SGD step (< 1e-5).
- The bubble ([perf]): p equal stages idle (p-1)/(m+p-1) of the time (0.5, 0.33, 0.2, 0.11 at p=2); measured,
  it stays above that and the gap grows with m (each micro-batch adds messages and overhead). --stage-ms keeps
  a stage busy (a sleep standing in for a GPU kernel) so compute dominates that overhead on a shared CPU.
- Interleaved 1F1B, v=2 stages per rank (r and r+p): bubble (p-1)/(v*m+p-1) for v times the messages; at m=p
  it idles less than 1F1B; with short stages (--stage-ms 40, m=8) the messages eat the gain. torch 2.13 also
  ships zero-bubble schedules (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble): not run here.
- Memory: GPipe as ScheduleGPipe runs it (no recompute; the paper keeps boundary activations only) holds all m
  micro-batches' activations, 1F1B at most p - pp_rank (PipeDream-Flush: it flushes, unlike 2018's PipeDream).
- Uneven micro-batches: (3, 3, 3, 1) give the full-batch loss when each micro-batch's mean loss is weighted by
  n_i/N. torch's schedules cut (3, 3, 2, 2) and in torch 2.13 fail ("Expected input batch_size (3) to match
  target batch_size (2)", the peer left waiting): they run here only when m divides N.
- Accumulating over schedule steps: `schedule.step()` accumulates its m micro-batches and never zeroes .grad,
  but ends by dividing ALL of .grad by m: two calls leave g/m + g, not 2g (section 4). Zero the gradients
  before each step() and raise m; or pass scale_grads=False and divide the loss yourself.
The machinery sits in common/pipeline/: naive (the split in one process), schedules (orders, theory), executor
(send/recv by hand), torch_schedules (torch's), stage_timers (clocks, the bubble), step (one recorded step).
Sources: GPipe arxiv.org/abs/1811.06965; PipeDream-Flush arxiv.org/abs/2006.09503; interleaved 1F1B
(Megatron-LM) arxiv.org/abs/2104.04473; zero bubble arxiv.org/abs/2401.10241;
pytorch.org/docs/stable/distributed.pipelining.html
"""

import argparse
from dataclasses import dataclass

import torch
import torch.nn as nn

from common.data import digit_rows
from common.harness.env import DistInfo, LessonError, read_torchrun_env
from common.harness.grid import Grid
from common.harness.options import comma_ints
from common.harness.ranks import gather_to_rank0, print0
from common.harness.results import Report
from common.harness.session import (
    add_distributed_args,
    barrier,
    distributed_session,
    rank0_only,
    run_main,
)
from common.measure.differences import nan_max  # a NaN anywhere makes the largest difference NaN
from common.models import mlp
from common.pipeline.naive import diff_from_unsplit, naive_split, unsplit_step
from common.pipeline.schedules import microbatch_sizes, plan_stages, schedule_limit, theory_bubble
from common.pipeline.stage_timers import measured_bubble
from common.pipeline.step import recorded_pipeline_step, step_row
from common.pipeline.torch_schedules import accumulation_across_steps

SCHEDULES = ("gpipe", "1f1b", "torch-gpipe", "torch-1f1b", "torch-interleaved-1f1b")
# float32 rounding: a pipelined step computes the unsplit step's numbers in another order
TOL = 1e-5
V = 2  # stages per rank of interleaved 1F1B: rank r holds stages r and r + p


@dataclass
class Run:
    """What every section shares: the options, this rank, the report, the grid (one pp dimension
    over the world) and the batch, the same on every rank: x (N, 64), y (N,)."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    grid: Grid
    x: torch.Tensor
    y: torch.Tensor


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--widths", default="64,64,64,64,64,64,64,64,10", help="mlp: 64 pixels to 10")
    p.add_argument("--batch-size", type=int, default=32, help="samples per step, global")
    p.add_argument("--microbatches", default="1,2,4,8", help="the values of m to run")
    p.add_argument(
        "--stages", type=int, default=None, help="pipeline stages p (default: world size)"
    )
    p.add_argument("--split-points", default=None, help="module indices where stages 1.. begin")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="subset of %(default)s")
    # a simulated kernel: ms of forward per rank for the whole batch (backward 2x; a micro-batch its share)
    p.add_argument("--stage-ms", type=float, default=200.0, help="simulated ms per batch; 0 = off")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate of the checked step")
    p.add_argument("--uneven", default="10,4", help="N,m of the uneven-micro-batch check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=None, help="rank 0 writes the numbers here (JSON)")
    args = add_distributed_args(p).parse_args(argv)
    # Validate before any process group exists: every rank sees the same argv and environment, so every rank
    # fails with the same line and none waits in a collective for a rank that already left.
    check_args(args, world_size=read_torchrun_env()[2])
    return args


def check_args(args, world_size: int) -> None:
    """Parse the lists and refuse what cannot run, with one line (the same on every rank)."""
    args.widths, args.microbatches = comma_ints(args.widths), comma_ints(args.microbatches)
    args.uneven = comma_ints(args.uneven)
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    bad = [s for s in args.schedules if s not in SCHEDULES]
    if bad:
        raise LessonError(f"unknown schedule {bad[0]!r}; choose from {', '.join(SCHEDULES)}")
    if (
        args.widths[:1] + args.widths[-1:] != [64, 10]
        or not args.microbatches
        or len(args.uneven) != 2
        or args.stage_ms < 0
        or args.lr <= 0
    ):
        raise LessonError(
            "--widths must run from 64 (pixels) to 10 (classes), --uneven is N,m, --stage-ms >= 0"
        )
    pts = comma_ints(args.split_points) if args.split_points else None
    # at most one stage per Linear layer
    args.max_stages = sum(isinstance(layer, nn.Linear) for layer in mlp(args.widths))
    try:
        args.stages, args.split_points = plan_stages(mlp(args.widths), world_size, args.stages, pts)
        for n, m in [(args.batch_size, m) for m in args.microbatches] + [tuple(args.uneven)]:
            microbatch_sizes(n, m)
    except ValueError as e:
        raise LessonError(str(e)) from None


def pipeline_step(run: Run, schedule: str, m: int, stage_ms: float, batch=None) -> dict:
    """One SGD step of this rank's stage(s): `schedule`, m micro-batches of `batch` (the run's x, y)."""
    x, y = batch or (run.x, run.y)
    return recorded_pipeline_step(
        schedule,
        run.grid,
        x,
        y,
        m,
        widths=run.args.widths,
        split_points=run.args.split_points,
        seed=run.args.seed,
        lr=run.args.lr,
        stage_ms=stage_ms,
        device=run.info.device,
        barrier=lambda: barrier(run.info),
        stages_per_rank=V,
    )


def memory_claims(report: Report, rows: dict, m: int, p: int) -> None:
    """GPipe holds the whole batch's activations for every m; 1F1B's stage k holds min(m, p-k)/m of them."""
    # the last stage also keeps a 4-byte loss scalar (nll_loss's total weight) per micro-batch
    if ("gpipe", 1) in rows:
        b1 = rows["gpipe", 1]["peak_activation_bytes"]
        off = max(
            abs(a - b - 4 * (mm - 1) * (k == p - 1))
            for (s, mm), r in rows.items()
            if s == "gpipe"
            for k, (a, b) in enumerate(zip(r["peak_activation_bytes"], b1))
        )
        report.claim(
            "gpipe_activation_bytes_same_for_every_m",
            off,
            "==",
            0,
            "GPipe holds the whole batch's activations at every m ({kib:.1f} KiB on stage 0): "
            "bytes off {value}",
            kib=b1[0] / 1024,
        )
    if ("gpipe", m) in rows and ("1f1b", m) in rows:
        g, f = rows["gpipe", m]["peak_activation_bytes"], rows["1f1b", m]["peak_activation_bytes"]
        off = max(abs(a / b - min(m, p - k) / m) for k, (a, b) in enumerate(zip(f, g)))
        report.claim(
            "1f1b_activation_bytes_fraction",
            off,
            "<=",
            1e-6,
            "1F1B, m={m}: stage k holds min(m, p-k)/m of GPipe's bytes ({kib} KiB): off {value:.1e}",
            m=m,
            kib=", ".join(f"{b / 1024:.1f}" for b in f),
        )


def bubble_claims(report: Report, rows: dict, ms: list[int], p: int, v: int) -> None:
    """Measured idle fractions against (p-1)/(v*m+p-1): timing, so [perf] lines with tolerant bounds."""
    measured = {k: measured_bubble(r["events"]) for k, r in rows.items()}
    gap = {k: measured[k]["bubble"] - r["theory_bubble"] for k, r in rows.items()}
    for (s, m), b in measured.items():
        report.perf(
            f"bubble_{s}_m{m}",
            b["bubble"],
            "{s:<23} m={m}: measured bubble {value:.3f} (theory {theory:.3f}), step span {ms:.0f} ms",
            s=s,
            m=m,
            theory=rows[s, m]["theory_bubble"],
            ms=1e3 * b["span_s"],
        )
    text = "bubble above theory (messages only add idle time): min(measured - theory) {value:+.3f}"
    report.claim("bubble_not_below_theory", min(gap.values()), ">=", -0.03, text, perf=True)
    report.claim(
        "bubble_within_0.1_of_theory",
        max(map(abs, gap.values())),
        "<=",
        0.1,
        "and close to it: largest |measured - theory| {value:.3f}",
        perf=True,
    )
    lo, hi = min(ms), max(ms)
    schedules = dict.fromkeys(s for s, _ in rows)
    grow = [gap[s, hi] - gap[s, lo] for s in schedules if {(s, lo), (s, hi)} <= {*gap}]
    if grow:
        report.claim(
            "bubble_gap_grows_with_m",
            sum(grow) / len(grow),
            ">=",
            0.0,
            "the gap grows with m (more messages): mean gap at m={hi} minus gap at m={lo} {value:+.3f}",
            hi=hi,
            lo=lo,
            perf=True,
        )
    # at the smallest m both ran: the largest difference in theory, the fewest messages
    both = [k for k in ms if {("torch-1f1b", k), ("torch-interleaved-1f1b", k)} <= rows.keys()]
    for m in both[:1]:
        less = measured["torch-1f1b", m]["bubble"] - measured["torch-interleaved-1f1b", m]["bubble"]
        report.claim(
            "interleaved_idles_less_than_1f1b",
            less,
            ">=",
            0.0,
            "interleaved 1F1B (v={v}) at m={m} idles {value:.3f} less than 1F1B (theory {theory:.3f})",
            v=v,
            m=m,
            theory=theory_bubble(p, m) - theory_bubble(p, m, v),
            perf=True,
        )


def report_accumulation(run: Run) -> None:
    """4. Gradient accumulation across schedule steps (torch.distributed.pipelining), measured on m = 2."""
    m = 2
    p = run.grid.size("pp")
    why = schedule_limit(
        "torch-gpipe", len(run.x), m, p, V, run.info.distributed, run.args.max_stages
    )
    if why:
        text = "\n4. two ScheduleGPipe steps: skipped: {value}"
        run.report.value("accumulation_across_steps_skipped", why, text)
        return
    args = run.args
    mine = accumulation_across_steps(
        args.widths, args.split_points, args.seed, run.grid, run.x, run.y, m, run.info.device
    )
    got = gather_to_rank0(mine, run.info)
    if not run.info.master_process:
        return
    worst = {k: nan_max(r[k] for r in got) for k in got[0]}
    print0(
        f"\n4. ScheduleGPipe(m={m}).step() twice on one batch, no zero_grad: .grad vs one step's g "
        "(relative to its largest |g|)"
    )
    run.report.claim(
        "schedule_steps_accumulate_g_over_m_plus_g",
        worst["vs_g_over_m_plus_g"],
        "<=",
        1e-5,
        "  |grad - (1 + 1/{m}) g| {value:.1e}: each step divides ALL of .grad by m (scale_grads=True)",
        m=m,
    )
    run.report.claim(
        "schedule_steps_do_not_accumulate_2g",
        -nan_max(-r["vs_2g"] for r in got),
        ">=",
        0.1,
        "  |grad - 2 g| {value:.2f}: not the sum of two steps; zero_grad between steps, or raise m",
    )
    run.report.claim(
        "scale_grads_false_accumulates",
        worst["fix_vs_g"],
        "<=",
        1e-5,
        "  scale_grads=False and a loss / (2 x {m}): two steps give their mean, |grad - g| {value:.1e}",
        m=m,
    )


def naive_section(run: Run) -> None:
    """1. The naive split, in one process: rank 0 alone, the others wait (unbounded by --timeout-s)."""
    with rank0_only(run.info, "the naive split") as mine:
        if not mine:
            return
        # under torchrun cuda:1 belongs to rank 1: two GPUs for the naive split in a plain run only
        two_gpus = run.info.device.type == "cuda" and not run.info.distributed
        naive = naive_split(
            run.args.widths,
            run.x,
            run.y,
            run.args.stage_ms,
            run.args.seed,
            run.info.device,
            two_gpus,
        )
        run.report.value(
            "naive",
            {k: naive[k] for k in ("devices", "events")},
            "naive split: stage 0 on {value[devices][0]}, stage 1 on {value[devices][1]}{simulated}",
            simulated=" (simulated)" if naive["simulated"] else "",
        )
        run.report.claim(
            "naive_split_equals_unsplit",
            naive["max_diff"],
            "<=",
            TOL,
            "naive split: loss and gradients equal the unsplit model's: max |difference| {value:.1e}",
        )
        text = "naive split: seconds both devices are busy at once {value:.1e}"
        run.report.claim("naive_split_one_device_at_a_time", naive["overlap_s"], "<=", 1e-4, text)
        if run.args.stage_ms > 0:
            run.report.claim(
                "naive_split_idle_fraction",
                abs(naive["idle_fraction"] - 0.5),
                "<=",
                0.1,
                "naive split: the two devices idle {idle:.3f} of the time, {value:.3f} from 1/2",
                idle=naive["idle_fraction"],
                perf=True,
            )


def run_schedules(run: Run, ref: dict) -> dict:
    """2. One SGD step per schedule and m: a table row each, on rank 0. Returns {(schedule, m): row}."""
    p, N = run.grid.size("pp"), run.args.batch_size
    print0(
        f"{'schedule':<23}{'m':>2}{'loss':>10}{'max|diff|':>11}{'theory bubble':>15}  peak live per rank"
    )
    rows: dict = {}  # (schedule, m) -> row, on rank 0
    for schedule in run.args.schedules:
        for m in run.args.microbatches:
            why = schedule_limit(schedule, N, m, p, V, run.info.distributed, run.args.max_stages)
            if why:
                text = "{s:<23}{m:>2}  skipped: {value}"
                run.report.value(f"skipped_{schedule}_m{m}", why, text, s=schedule, m=m)
                continue
            got = gather_to_rank0(pipeline_step(run, schedule, m, run.args.stage_ms), run.info)
            if not run.info.master_process:
                continue
            rows[schedule, m] = run.report.value(
                f"step_{schedule}_m{m}",
                step_row(schedule, m, got, ref),
                "{s:<23}{m:>2}{value[loss]:>10.6f}{value[max_diff]:>11.1e}"
                "{value[theory_bubble]:>15.3f}  {value[peak_live]}",
                s=schedule,
                m=m,
            )
    return rows


def pipelines_section(run: Run) -> None:
    """2. Pipelines: every schedule and m against the unsplit model's step; what they hold; the bubble."""
    ref = unsplit_step(
        run.args.widths, run.x, run.y, run.args.lr, run.args.seed
    )  # every rank: cheap, the same
    rows = run_schedules(run, ref)
    for s in dict.fromkeys(s for s, _ in rows):  # each schedule, over every m
        run.report.claim(
            f"{s}_equals_unsplit",
            nan_max(r["max_diff"] for k, r in rows.items() if k[0] == s),
            "<=",
            TOL,
            "{s}: loss, gradients and SGD step = unsplit: max |difference| {value:.1e}",
            s=s,
        )
    if not rows:
        return
    differ = sum(
        a != b for r in rows.values() for a, b in zip(r["peak_live"], r["peak_live_in_order"])
    )
    run.report.claim(
        "peak_live_as_scheduled",
        differ,
        "==",
        0,
        "micro-batches held at once as scheduled (GPipe m, 1F1B min(m, p - pp_rank)): ranks off {value}",
    )
    p = run.grid.size("pp")
    memory_claims(run.report, rows, max(run.args.microbatches), p)
    if run.args.stage_ms > 0 and p > 1:
        bubble_claims(run.report, rows, run.args.microbatches, p, V)


def uneven_section(run: Run) -> None:
    """3. Uneven micro-batches, hand-written GPipe: weight each micro-batch's mean loss by n_i / N."""
    n_u, m_u = run.args.uneven
    xu, yu = digit_rows(n_u, run.args.seed + 7)
    got = gather_to_rank0(pipeline_step(run, "gpipe", m_u, 0.0, batch=(xu, yu)), run.info)
    if not run.info.master_process:
        return
    run.report.value(
        "uneven_sizes", microbatch_sizes(n_u, m_u), "uneven: {n} samples as {value}", n=n_u
    )
    ref = unsplit_step(run.args.widths, xu, yu, run.args.lr, run.args.seed)
    run.report.claim(
        "uneven_weighted_loss_equals_unsplit",
        diff_from_unsplit(got, ref)["max_diff"],
        "<=",
        TOL,
        "uneven: micro-batch losses weighted by n_i/N give the unsplit step: max |difference| {value:.1e}",
    )


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        report = Report(info)
        # one pipeline over the whole world: pp_rank = coords["pp"]
        grid = Grid(info, pp=info.world_size)
        x, y = digit_rows(args.batch_size, args.seed)
        report.value(
            "pp_ranks",
            grid.ranks_in("pp"),
            "model mlp({a.widths}) cut at {a.split_points}: {p} stage(s) on ranks {value}; "
            "batch {a.batch_size}; backend {backend}, {device}",
            a=args,
            p=grid.size("pp"),
            backend=info.backend or "none",
            device=info.device.type,
        )
        run = Run(args, info, report, grid, x, y)
        naive_section(run)
        pipelines_section(run)
        uneven_section(run)
        report_accumulation(run)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
