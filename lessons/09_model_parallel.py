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
  micro-batches' activations, 1F1B at most p - pp_rank; this 1F1B flushes: PipeDream-Flush, not 2018's
  PipeDream.
- Uneven micro-batches: (3, 3, 3, 1) give the full-batch loss when each micro-batch's mean loss is weighted by
  n_i/N. torch's schedules cut (3, 3, 2, 2) and in torch 2.13 fail ("Expected input batch_size (3) to match
  target batch_size (2)", the peer left waiting): they run here only when m divides N.
- Accumulating over several schedule steps: `schedule.step()` is itself gradient accumulation over its m
  micro-batches, and it does not zero .grad between calls, but each call ends by dividing ALL of .grad by m
  (scale_grads=True): two calls on one batch leave g/m + g, not 2g (measured, section 4). Zero the gradients
  before each step() and raise m instead; or pass scale_grads=False and divide the loss yourself.
Sources: GPipe arxiv.org/abs/1811.06965; PipeDream-Flush arxiv.org/abs/2006.09503; interleaved 1F1B
(Megatron-LM) arxiv.org/abs/2104.04473; zero bubble arxiv.org/abs/2401.10241;
pytorch.org/docs/stable/distributed.pipelining.html
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.data import digits_split
from common.harness.env import LessonError, read_torchrun_env
from common.harness.grid import Grid
from common.harness.ranks import gather_to_rank0, print0
from common.harness.results import Report
from common.harness.session import (
    add_distributed_args,
    barrier,
    distributed_session,
    rank0_only,
    run_main,
    set_seed,
)
from common.measure.differences import nan_max  # a NaN anywhere makes the largest difference NaN
from common.models import mlp
from common.pipeline.executor import run_pipeline_step
from common.pipeline.schedules import (
    default_split_points,
    interleaved_stage_indices,
    microbatch_sizes,
    peak_live_in_order,
    schedule_limit,
    schedule_order,
    split_model,
    theory_bubble,
)
from common.pipeline.stage_timers import (
    SimulatedKernel,
    TimedStage,
    busy_overlap_s,
    measured_bubble,
    peak_live,
    record_step,
)

CPU = torch.device("cpu")
SCHEDULES = ("gpipe", "1f1b", "torch-gpipe", "torch-1f1b", "torch-interleaved-1f1b")
TOL = (
    1e-5  # float32 rounding: a pipelined step computes the unsplit step's numbers in another order
)
V = 2  # stages per rank of interleaved 1F1B: rank r holds stages r and r + p
# a row's lists, one per rank
PER_RANK = ("peak_live", "peak_live_in_order", "peak_activation_bytes", "events")


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise LessonError(f"expected comma-separated integers, got {text!r}") from None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--widths", default="64,64,64,64,64,64,64,64,10", help="mlp widths, 64 pixels to 10 classes"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="samples per step (global: cut into micro-batches)",
    )
    p.add_argument(
        "--microbatches", default="1,2,4,8", help="values of m to run (default %(default)s)"
    )
    p.add_argument(
        "--stages", type=int, default=None, help="pipeline stages p (default: the world size)"
    )
    p.add_argument("--split-points", default=None, help="module indices where stages 1.. begin")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="subset of %(default)s")
    p.add_argument(
        "--stage-ms",
        type=float,
        default=200.0,
        help="simulated kernel: ms of forward per rank "
        "for the whole batch (backward 2x; a micro-batch takes its share); 0 = off",
    )
    p.add_argument(
        "--lr", type=float, default=0.1, help="SGD learning rate of the one checked step"
    )
    p.add_argument(
        "--uneven", default="10,4", help="N,m of the uneven-micro-batch check (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--results", default=None, help="rank 0 writes the reported numbers here as JSON"
    )
    args = add_distributed_args(p).parse_args(argv)
    # Validate before any process group exists: every rank sees the same argv and environment, so every rank
    # fails with the same line and none waits in a collective for a rank that already left.
    world_size = read_torchrun_env()[2]
    args.widths, args.microbatches = _ints(args.widths), _ints(args.microbatches)
    args.uneven = _ints(args.uneven)
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
    model, pts = mlp(args.widths), _ints(args.split_points) if args.split_points else None
    try:
        args.stages = args.stages or (len(pts) + 1 if pts else world_size)
        if args.stages != world_size:
            raise LessonError(
                f"{args.stages} pipeline stages need {args.stages} processes (one stage per "
                f"rank), but the world size is {world_size}"
            )
        args.split_points = pts or default_split_points(model, args.stages)
        if len(split_model(model, args.split_points)) != args.stages:
            raise LessonError(
                f"--split-points make {len(args.split_points) + 1} stages, --stages {args.stages}"
            )
        for n, m in [(args.batch_size, m) for m in args.microbatches] + [tuple(args.uneven)]:
            microbatch_sizes(n, m)
    except ValueError as e:
        raise LessonError(str(e)) from None
    return args


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n digits picked by a seeded permutation, the same on every rank: x (n, 64) flattened 8x8 images,
    y (n,)."""
    images, labels = digits_split()[0].tensors  # (1438, 1, 8, 8), (1438,)
    pick = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed + 1))[:n]
    return images[pick].flatten(1), labels[pick]  # (n, 64), (n,)


def reference_step(widths, x, y, lr, seed) -> dict:
    """The unsplit model on the whole batch, one process: loss, every gradient, parameters after SGD."""
    set_seed(seed)
    model = mlp(widths)
    loss = F.cross_entropy(model(x), y)  # mean over the N samples
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return {
        "loss": loss.item(),
        "grads": grads,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def naive_split(widths, x, y, stage_ms: float, seed: int, device=CPU, two_gpus=False) -> dict:
    """Two stages in ONE process, on cuda:0 and cuda:1 (two_gpus) or both on `device` ("simulated"): the batch
    goes through one, then the other. Returns devices, busy intervals, overlap, idle fraction, and the
    largest difference."""
    two_gpus = two_gpus and torch.cuda.device_count() >= 2
    devs = [torch.device("cuda:0"), torch.device("cuda:1")] if two_gpus else [device] * 2
    set_seed(seed)
    model = mlp(widths)
    stages = [
        TimedStage(nn.Sequential(*s, SimulatedKernel(stage_ms / len(x))), k).to(d)
        for k, (s, d) in enumerate(zip(split_model(model, default_split_points(model, 2)), devs))
    ]
    stages[1].t0 = stages[0].t0  # one process, one clock
    h = stages[0](x.to(devs[0]))  # stage 0 works, stage 1 waits
    out = stages[1](h.to(devs[1]))  # the activation crosses to device 1; now stage 0 waits
    loss = F.cross_entropy(out, y.to(devs[1]))  # targets live where the logits are
    loss.backward()  # the gradient flows back across the boundary (autograd moves it to devs[0])
    ref = reference_step(widths, x, y, 0.1, seed)
    diffs = [
        (p.grad.cpu() - g).abs().max().item() for p, g in zip(model.parameters(), ref["grads"])
    ]
    events = [s.events for s in stages]
    return {
        "devices": [str(d) for d in devs],
        "simulated": not two_gpus,
        "events": events,
        "overlap_s": busy_overlap_s(events),
        "idle_fraction": measured_bubble(events)["bubble"],
        "max_diff": nan_max([abs(loss.item() - ref["loss"]), *diffs]),
    }


def pipeline_step(schedule: str, args, info, grid: Grid, x, y, m: int, stage_ms: float) -> dict:
    """One SGD step of this rank's stage(s) under `schedule` with m micro-batches; what this rank saw."""
    p, pp_rank = grid.size("pp"), grid.coords["pp"]
    pp_is_first_stage, pp_is_last_stage = grid.is_first("pp"), grid.is_last("pp")
    v = V if schedule.endswith("interleaved-1f1b") else 1
    indices = interleaved_stage_indices(p, v, pp_rank)  # [pp_rank] when v == 1
    set_seed(args.seed)  # every rank builds the whole model from the same seed and keeps its stages
    model = mlp(args.widths)
    parts = split_model(model, args.split_points if v == 1 else default_split_points(model, p * v))
    timed = [
        TimedStage(nn.Sequential(*parts[i], SimulatedKernel(0.0)), i).to(info.device)
        for i in indices
    ]
    sizes, order = microbatch_sizes(len(x), m), schedule_order(schedule, m, p, pp_rank, v)
    if schedule in (
        "gpipe",
        "1f1b",
    ):  # the hand-written executor: send/recv in the schedule's order
        in_features = next(
            layer.in_features for layer in parts[pp_rank] if isinstance(layer, nn.Linear)
        )

        def step():
            res = run_pipeline_step(
                timed[0],
                order,
                pp_rank=pp_rank,
                pp_world_size=p,
                sizes=sizes,
                recv_shape=(in_features,),
                stage_ranks=grid.ranks_in("pp"),
                inputs=list(x.split(sizes)) if pp_is_first_stage else [],
                targets=list(y.split(sizes)) if pp_is_last_stage else [],
                loss_fn=F.cross_entropy,
                device=info.device,
            )
            return res.loss, res.peak_activation_bytes
    else:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        stages = [
            PipelineStage(t, i, p * v, info.device, group=grid.group("pp"))
            for t, i in zip(timed, indices)
        ]
        # Mean loss per micro-batch; the schedule divides the summed gradients by m (scale_grads=True), which
        # is the full-batch mean only when the micro-batches are equal: hence m must divide N here.
        if v > 1:
            sched = ScheduleInterleaved1F1B(stages, m, loss_fn=F.cross_entropy)
        else:
            schedule_cls = {"torch-gpipe": ScheduleGPipe, "torch-1f1b": Schedule1F1B}[schedule]
            sched = schedule_cls(stages[0], m, F.cross_entropy)

        def step():
            losses: list = []
            sched.step(
                *([x.to(info.device)] if pp_is_first_stage else []),
                **({"target": y.to(info.device), "losses": losses} if pp_is_last_stage else {}),
            )
            return (torch.stack(losses).mean().item() if pp_is_last_stage else None), None

    # a warm-up step with the simulated kernel off, then the recorded one (the rank's v stages share its work)
    (loss, peak_bytes), events = record_step(
        step, timed, lambda: barrier(info), stage_ms / len(x) / v
    )
    grads = {t.stage_index: [q.grad.detach().cpu().clone() for q in t.parameters()] for t in timed}
    torch.optim.SGD([q for t in timed for q in t.parameters()], lr=args.lr).step()
    return {
        "loss": loss,
        "events": events,
        "grads": grads,
        "peak_activation_bytes": peak_bytes,
        "v": v,
        "params": {
            t.stage_index: [q.detach().cpu().clone() for q in t.parameters()] for t in timed
        },
        "peak_live": peak_live(events),
        "peak_live_in_order": peak_live_in_order(order),
    }


def compare(got: list[dict], ref: dict) -> dict:
    """Rank 0: the ranks' stages put back in model order; the largest difference from the unsplit step."""
    by_stage = {i: (r["grads"][i], r["params"][i]) for r in got for i in r["grads"]}
    mine = [t for k in (0, 1) for i in sorted(by_stage) for t in by_stage[i][k]]
    diffs = [
        (a - b).abs().max().item() for a, b in zip(mine, ref["grads"] + ref["params"], strict=True)
    ]
    return {
        "loss": got[-1]["loss"],
        "max_diff": nan_max([abs(got[-1]["loss"] - ref["loss"]), *diffs]),
    }


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
            "GPipe: every stage holds the "
            f"whole batch's activations ({b1[0] / 1024:.1f} KiB on stage 0) for every m; bytes off "
            "{value}",
        )
    if ("gpipe", m) in rows and ("1f1b", m) in rows:
        g, f = rows["gpipe", m]["peak_activation_bytes"], rows["1f1b", m]["peak_activation_bytes"]
        off = max(abs(a / b - min(m, p - k) / m) for k, (a, b) in enumerate(zip(f, g)))
        kib = ", ".join(f"{b / 1024:.1f}" for b in f)
        report.claim(
            "1f1b_activation_bytes_fraction",
            off,
            "<=",
            1e-6,
            f"1F1B, m={m}: stage k holds "
            f"min(m, p-k)/m of GPipe's activation bytes ({kib} KiB); off by {{value:.1e}}",
        )


def bubble_claims(report: Report, rows: dict, ms: list[int], p: int, v: int) -> None:
    """Measured idle fractions against (p-1)/(v*m+p-1): timing, so [perf] lines with tolerant bounds."""
    measured = {k: measured_bubble(r["events"]) for k, r in rows.items()}
    gap = {k: measured[k]["bubble"] - r["theory_bubble"] for k, r in rows.items()}
    for (s, m), b in measured.items():
        report.perf(
            f"bubble_{s}_m{m}",
            b["bubble"],
            f"{s:<23} m={m}: measured bubble {{value:.3f}} (theory "
            f"{rows[s, m]['theory_bubble']:.3f}), step span {1e3 * b['span_s']:.0f} ms",
        )
    report.claim(
        "bubble_not_below_theory",
        min(gap.values()),
        ">=",
        -0.03,
        "the measured bubble stays above "
        "theory (messages only add idle time): lowest measured - theory {value:+.3f}",
        perf=True,
    )
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
            "the gap grows with m "
            f"(more messages): mean over schedules of gap at m={hi} minus gap at m={lo} "
            "{value:+.3f}",
            perf=True,
        )
    # at the smallest m both ran: the largest difference in theory, the fewest messages
    for m in [k for k in ms if ("torch-1f1b", k) in rows and ("torch-interleaved-1f1b", k) in rows][
        :1
    ]:
        less = measured["torch-1f1b", m]["bubble"] - measured["torch-interleaved-1f1b", m]["bubble"]
        theory = theory_bubble(p, m) - theory_bubble(p, m, v)
        report.claim(
            "interleaved_idles_less_than_1f1b",
            less,
            ">=",
            0.0,
            f"interleaved 1F1B (v={v}) at "
            f"m={m} idles {{value:.3f}} less than 1F1B (theory {theory:.3f})",
            perf=True,
        )


def accumulation_across_steps(args, info, grid: Grid, x, y, m: int) -> dict:
    """`schedule.step()` twice on one batch, no zero_grad, this rank's stage: .grad's largest |difference|
    from (1 + 1/m) and from 2 times one call's g, relative to max |g|; and with scale_grads=False and the loss
    / 2m (the fix), from g. torch 2.13 (pipelining/schedules.py, stage.py): step() never clears parameter
    gradients (`clear_runtime_states` resets only received inputs' .grad), so they accumulate across calls,
    but with scale_grads=True (the default) each step ends by dividing ALL of .grad by m, the previous call's
    share included: two calls leave g/m + g, not 2g."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    p, pp_rank = grid.size("pp"), grid.coords["pp"]

    def grads_after(calls: int, scale_grads: bool = True) -> list[torch.Tensor]:
        set_seed(args.seed)  # the same start every time
        part = split_model(mlp(args.widths), args.split_points)[pp_rank]
        module = nn.Sequential(*part).to(info.device)
        stage = PipelineStage(module, pp_rank, p, info.device, group=grid.group("pp"))

        def loss_fn(
            out, target
        ):  # scale_grads=False: the mean over 2 steps of m micro-batches, by hand
            return F.cross_entropy(out, target) / (2 * m)

        sched = ScheduleGPipe(
            stage, m, F.cross_entropy if scale_grads else loss_fn, scale_grads=scale_grads
        )
        for _ in range(calls):  # no zero_grad between the calls
            sched.step(
                *([x.to(info.device)] if grid.is_first("pp") else []),
                **({"target": y.to(info.device)} if grid.is_last("pp") else {}),
            )
        return [q.grad.detach().cpu().clone() for q in module.parameters()]

    one, two, fixed = grads_after(1), grads_after(2), grads_after(2, scale_grads=False)
    top = torch.stack([g.abs().max() for g in one]).max()

    def off(got, factor: float) -> float:  # NaN anywhere propagates (torch's max keeps it)
        return (
            torch.stack([(a - factor * b).abs().max() for a, b in zip(got, one)]).max() / top
        ).item()

    return {
        "vs_g_over_m_plus_g": off(two, 1 + 1 / m),
        "vs_2g": off(two, 2.0),
        "fix_vs_g": off(fixed, 1.0),
    }


def report_accumulation(args, info, grid: Grid, x, y, report: Report) -> None:
    """4. Gradient accumulation across schedule steps (torch.distributed.pipelining), measured on m = 2."""
    m, layers = 2, sum(isinstance(layer, nn.Linear) for layer in mlp(args.widths))
    why = schedule_limit(
        "torch-gpipe", len(x), m, grid.size("pp"), V, info.distributed, max_stages=layers
    )
    if why:
        report.value(
            "accumulation_across_steps_skipped",
            why,
            "\n4. two ScheduleGPipe steps: skipped: {value}",
        )
        return
    got = gather_to_rank0(accumulation_across_steps(args, info, grid, x, y, m), info)
    if not info.master_process:
        return
    worst = {k: nan_max(r[k] for r in got) for k in got[0]}
    print0(
        f"\n4. ScheduleGPipe(m={m}).step() twice on one batch, no zero_grad: .grad vs one step's g "
        "(relative to its largest |g|)"
    )
    report.claim(
        "schedule_steps_accumulate_g_over_m_plus_g",
        worst["vs_g_over_m_plus_g"],
        "<=",
        1e-5,
        f"  |grad - (1 + 1/{m}) g| {{value:.1e}}: each step divides ALL of .grad by m "
        "(scale_grads=True)",
    )
    report.claim(
        "schedule_steps_do_not_accumulate_2g",
        -nan_max(-r["vs_2g"] for r in got),
        ">=",
        0.1,
        "  |grad - 2 g| {value:.2f}: not the sum of two steps; zero_grad between steps, or raise m",
    )
    report.claim(
        "scale_grads_false_accumulates",
        worst["fix_vs_g"],
        "<=",
        1e-5,
        "  scale_grads=False and a "
        f"loss / (2 x {m}): two steps give their mean, |grad - g| {{value:.1e}}",
    )


def naive_section(args, info, x, y, report: Report) -> None:
    """1. The naive split, in one process: rank 0 alone, the others wait (unbounded by --timeout-s)."""
    with rank0_only(info, "the naive split") as mine:
        if not mine:
            return
        # under torchrun cuda:1 belongs to rank 1: two GPUs for the naive split in a plain run only
        naive = naive_split(
            args.widths,
            x,
            y,
            args.stage_ms,
            args.seed,
            info.device,
            two_gpus=info.device.type == "cuda" and not info.distributed,
        )
        report.value(
            "naive",
            {k: naive[k] for k in ("devices", "events")},
            "naive split: stage 0 on "
            "{value[devices][0]}, stage 1 on {value[devices][1]}"
            + " (simulated)"
            * naive["simulated"],
        )
        report.claim(
            "naive_split_equals_unsplit",
            naive["max_diff"],
            "<=",
            TOL,
            "naive split: loss and "
            "gradients equal the unsplit model's: max |difference| {value:.1e}",
        )
        report.claim(
            "naive_split_one_device_at_a_time",
            naive["overlap_s"],
            "<=",
            1e-4,
            "naive split: seconds both devices are busy at once {value:.1e}",
        )
        if args.stage_ms > 0:
            report.claim(
                "naive_split_idle_fraction",
                abs(naive["idle_fraction"] - 0.5),
                "<=",
                0.1,
                f"naive split: the two devices idle {naive['idle_fraction']:.3f} of the time, "
                f"{{value:.3f}} from 1/2",
                perf=True,
            )


def pipelines_section(args, info, grid: Grid, x, y, report: Report) -> None:
    """2. Pipelines: one SGD step per schedule and m, checked against the unsplit model's step."""
    p, N, ms = grid.size("pp"), args.batch_size, args.microbatches
    ref = reference_step(args.widths, x, y, args.lr, args.seed)  # on every rank: cheap and the same
    layers = sum(
        isinstance(layer, nn.Linear) for layer in mlp(args.widths)
    )  # at most this many stages
    print0(
        f"{'schedule':<23}{'m':>2}{'loss':>10}{'max|diff|':>11}{'theory bubble':>15}  peak live per rank"
    )
    rows: dict = {}  # (schedule, m) -> row, on rank 0
    for schedule in args.schedules:
        for m in ms:
            why = schedule_limit(schedule, N, m, p, V, info.distributed, max_stages=layers)
            if why:
                report.value(
                    f"skipped_{schedule}_m{m}", why, f"{schedule:<23}{m:>2}  skipped: {{value}}"
                )
                continue
            got = gather_to_rank0(
                pipeline_step(schedule, args, info, grid, x, y, m, args.stage_ms), info
            )
            if info.master_process:
                row = {
                    "schedule": schedule,
                    "m": m,
                    **compare(got, ref),
                    "theory_bubble": theory_bubble(p, m, got[0]["v"]),
                    **{k: [r[k] for r in got] for k in PER_RANK},
                }
                rows[schedule, m] = report.value(
                    f"step_{schedule}_m{m}",
                    row,
                    f"{schedule:<23}{m:>2}"
                    "{value[loss]:>10.6f}{value[max_diff]:>11.1e}"
                    "{value[theory_bubble]:>15.3f}  {value[peak_live]}",
                )
    for s in dict.fromkeys(s for s, _ in rows):  # each schedule, over every m
        worst = nan_max(r["max_diff"] for k, r in rows.items() if k[0] == s)
        report.claim(
            f"{s}_equals_unsplit",
            worst,
            "<=",
            TOL,
            f"{s}: loss, gradients, parameters after SGD = unsplit: max |difference| {{value:.1e}}",
        )
    if rows:
        differ = sum(
            a != b for r in rows.values() for a, b in zip(r["peak_live"], r["peak_live_in_order"])
        )
        report.claim(
            "peak_live_as_scheduled",
            differ,
            "==",
            0,
            "micro-batches held at once as each schedule "
            "orders them (GPipe m, 1F1B min(m, p - pp_rank)): ranks that differ {value}",
        )
        memory_claims(report, rows, max(ms), p)
        if args.stage_ms > 0 and p > 1:
            bubble_claims(report, rows, ms, p, V)


def uneven_section(args, info, grid: Grid, report: Report) -> None:
    """3. Uneven micro-batches, hand-written GPipe: weight each micro-batch's mean loss by n_i / N."""
    n_u, m_u = args.uneven
    xu, yu = make_data(n_u, args.seed + 7)
    got = gather_to_rank0(pipeline_step("gpipe", args, info, grid, xu, yu, m_u, 0.0), info)
    if info.master_process:
        report.value(
            "uneven_sizes", microbatch_sizes(n_u, m_u), f"uneven: {n_u} samples as {{value}}"
        )
        diff = compare(got, reference_step(args.widths, xu, yu, args.lr, args.seed))["max_diff"]
        report.claim(
            "uneven_weighted_loss_equals_unsplit",
            diff,
            "<=",
            TOL,
            "uneven: each micro-batch's "
            "mean loss weighted by n_i/N gives the unsplit loss, gradients and parameters: "
            "max |difference| {value:.1e}",
        )


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        report = Report(info)
        grid = Grid(
            info, pp=info.world_size
        )  # one pipeline over the whole world: pp_rank = coords["pp"]
        x, y = make_data(args.batch_size, args.seed)
        report.value(
            "pp_ranks",
            grid.ranks_in("pp"),
            f"model mlp({args.widths}) cut at {args.split_points}: "
            f"{grid.size('pp')} stage(s) on ranks {{value}}; batch {args.batch_size}; backend "
            f"{info.backend or 'none'}, {info.device.type}",
        )
        naive_section(args, info, x, y, report)
        pipelines_section(args, info, grid, x, y, report)
        uneven_section(args, info, grid, report)
        report_accumulation(args, info, grid, x, y, report)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
