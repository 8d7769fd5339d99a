"""Lesson 07: model parallelism -- a naive split, then pipelines (GPipe and 1F1B, by hand and with PyTorch's).

Run it:

    python lessons/07_model_parallel.py                                     # naive split + a 1-stage "pipeline"
    torchrun --standalone --nproc_per_node=2 lessons/07_model_parallel.py   # 2 stages, one per rank
    torchrun --standalone --nproc_per_node=4 lessons/07_model_parallel.py --stage-ms 0 --bench-steps 0
    torchrun --standalone --nproc_per_node=2 lessons/07_model_parallel.py --stage-ms 0 --microbatches 1,4 \\
        --bench-steps 5 --bench-width 1024 --bench-batch 2048  # the speed benchmark alone: m=4 ~1.45x faster

What to look for:
- Naive split (one process): stage 0 then stage 1, on cuda:0 and cuda:1 with two GPUs, otherwise both on the CPU
  ("simulated"). The activation is moved to the next device at the boundary, and the targets to the last one.
  Only one device works at a time (the stages run one after the other by construction; the recorded busy
  intervals and the idle fraction of about 0.5 illustrate it).
- Pipelines (one stage per rank, activations and gradients by send/recv): for every schedule (hand-written GPipe
  and 1F1B, torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B) and m in 1, 2, 4, 8 the loss, every
  gradient and every parameter after an SGD step equal the unsplit model's on the same batch (< 1e-5).
- The bubble: the measured idle fraction ([perf] lines) approaches (p-1)/(m+p-1) -- 0.5, 0.33, 0.2, 0.11 at
  p=2 -- from above: each micro-batch adds a send/recv, so the excess grows with m (about 0.5, 0.34, 0.22-0.25,
  0.16-0.19 measured here; the tests require each within 0.1 of theory).
  --stage-ms makes each stage busy for a fixed time (a sleep standing in for a GPU kernel), so compute dominates
  communication even on a shared 2-core CPU; it does not change any number the model computes.
- Memory: GPipe keeps the activations of all m micro-batches on every stage; 1F1B keeps at most p - pp_rank.
- Uneven micro-batches: 10 samples into 4 micro-batches (3, 3, 3, 1) give the full-batch loss when each
  micro-batch's mean loss is weighted by n_i/N. PyTorch's schedules cut with tensor_split (3, 3, 2, 2) but in
  torch 2.13 the stage reuses the first micro-batch's shape and fails, so they run only when m divides N.
- [perf] benchmark: real compute (wide Linear layers, no sleep), m=4 against m=1: the step-time ratio
  (theory 4p/(p+3) = 1.6 at p=2) and the bubbles measured in those steps.
- Next: pipeline parallelism composes with data parallelism: a 2-D grid of ranks, pp_rank along a pipeline and
  dp_rank across replicas, gradients all-reduced over each stage's dp group (picotron, Megatron-LM).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from common.checkpoint import write_results
from common.data import digits_split
from common.ranks import gather_to_rank0, print0
from common.session import (LessonError, add_distributed_args, barrier, distributed_session, read_torchrun_env,
                            run_main, set_seed)
from common.models import mlp
from common.pipeline import (SimulatedKernel, TimedStage, default_split_points, gpipe_order, measured_bubble,
                             microbatch_sizes, one_f_one_b_order, run_pipeline_step, split_model, theory_bubble)

SCHEDULES = ("gpipe", "1f1b", "torch-gpipe", "torch-1f1b")


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise LessonError(f"expected comma-separated integers, got {text!r}") from None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--widths", default="64,64,64,64,64,10", help="mlp widths: input, hidden..., classes "
                   "(64 inputs and 10 classes: the digits, flattened; otherwise random data)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per training step; the whole batch enters "
                   "stage 0 and is cut into micro-batches (default %(default)s)")
    p.add_argument("--microbatches", default="1,2,4,8", help="values of m to run (default %(default)s)")
    p.add_argument("--stages", type=int, default=None, help="pipeline stages p (default: the world size; "
                   "one stage per rank)")
    p.add_argument("--split-points", default=None, help="module indices where stages 1.. begin, e.g. 4 "
                   "(default: equal numbers of Linear layers)")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="subset of %(default)s")
    p.add_argument("--stage-ms", type=float, default=40.0, help="simulated kernel: ms a stage is busy in forward "
                   "for the whole batch (backward 2x; a micro-batch takes its share); 0 = real compute only")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate of the one checked step")
    p.add_argument("--uneven", default="10,4", help="batch,m of the uneven-micro-batch check (default %(default)s)")
    p.add_argument("--bench-steps", type=int, default=3, help="timed steps per m in the benchmark; 0 skips it")
    p.add_argument("--bench-width", type=int, default=768, help="benchmark model: 4 Linear(W, W), real compute")
    p.add_argument("--bench-batch", type=int, default=128, help="benchmark batch size (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=None, help="rank 0 writes the reported numbers here as JSON")
    add_distributed_args(p)
    args = p.parse_args(argv)

    # Validate before any process group exists: every rank sees the same argv and environment, so every rank
    # fails with the same line and none waits in a collective for a rank that already left.
    _, _, world_size, _ = read_torchrun_env()
    args.widths = _ints(args.widths)
    args.microbatches = _ints(args.microbatches)
    args.uneven = _ints(args.uneven)
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    if bad := [s for s in args.schedules if s not in SCHEDULES]:
        raise LessonError(f"unknown schedule {bad[0]!r}; choose from {', '.join(SCHEDULES)}")
    if len(args.widths) < 2:
        raise LessonError(f"--widths needs at least 2 numbers, got {args.widths}")
    if args.batch_size < 1 or not args.microbatches or min(args.microbatches) < 1:
        raise LessonError("--batch-size and every --microbatches value must be positive")
    model = mlp(args.widths)
    if args.split_points is not None:
        args.split_points = _ints(args.split_points)
        try:
            split_model(model, args.split_points)
        except ValueError as e:
            raise LessonError(f"--split-points: {e}") from None
        if args.stages is None:
            args.stages = len(args.split_points) + 1
    args.stages = world_size if args.stages is None else args.stages
    if args.stages != world_size:
        raise LessonError(f"{args.stages} pipeline stages need {args.stages} processes (one stage per rank), "
                          f"but the world size is {world_size}")
    if args.split_points is None:
        try:
            args.split_points = default_split_points(model, args.stages)
        except ValueError as e:
            raise LessonError(f"--widths: {e}") from None
    elif len(args.split_points) + 1 != args.stages:
        raise LessonError(f"--split-points {args.split_points} make {len(args.split_points) + 1} stages, "
                          f"--stages says {args.stages}")
    for m in args.microbatches:
        try:
            microbatch_sizes(args.batch_size, m)
        except ValueError as e:
            raise LessonError(f"--microbatches: {e}") from None
    if len(args.uneven) != 2:
        raise LessonError(f"--uneven is N,m, got {args.uneven}")
    try:
        microbatch_sizes(*args.uneven)
    except ValueError as e:
        raise LessonError(f"--uneven: {e}") from None
    if args.stage_ms < 0 or args.lr <= 0 or args.bench_steps < 0:
        raise LessonError("--stage-ms and --bench-steps must be >= 0 and --lr > 0")
    if args.bench_steps and (args.bench_batch < 4 or args.bench_width < 1):
        raise LessonError("--bench-batch must be >= 4 (the benchmark cuts it into 4 micro-batches)")
    return args


def make_data(widths: list[int], n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch, the same on every rank: x (n, widths[0]), y (n,) in 0..widths[-1]-1.

    With the default widths (64 inputs, 10 classes) it is n real digits (8x8 images flattened to 64 pixels),
    drawn by a seeded permutation of the training set; for other widths (the benchmark) standard normal data.
    """
    g = torch.Generator().manual_seed(seed + 1)
    if widths[0] == 64 and widths[-1] == 10:
        images, labels = digits_split()[0].tensors  # (1438, 1, 8, 8), (1438,)
        pick = torch.randperm(len(labels), generator=g)[:n]
        return images[pick].flatten(1), labels[pick]  # (n, 64), (n,)
    return torch.randn(n, widths[0], generator=g), torch.randint(0, widths[-1], (n,), generator=g)


def reference_step(widths, x, y, lr, seed) -> dict:
    """The unsplit model on the whole batch, one process: loss, every gradient, parameters after SGD."""
    set_seed(seed)
    model = mlp(widths)
    loss = F.cross_entropy(model(x), y)  # mean over the N samples
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return {"loss": loss.item(), "grads": grads, "params": [p.detach().clone() for p in model.parameters()]}


def naive_split(widths, x, y, stage_ms: float, seed: int, want_cuda: bool = True) -> dict:
    """Two stages in ONE process, each on its own device; the batch goes through them one after the other.

    Devices: cuda:0 and cuda:1 when two GPUs are visible (and want_cuda), otherwise both on the CPU ("simulated":
    same code, same data movement, one device). Returns the devices, each stage's recorded busy intervals, their
    overlap (0: only one device computes at a time), the idle fraction of the two devices and the largest
    difference of loss and gradients from the unsplit model.
    """
    two_gpus = want_cuda and torch.cuda.is_available() and torch.cuda.device_count() >= 2
    devs = [torch.device("cuda:0"), torch.device("cuda:1")] if two_gpus else [torch.device("cpu")] * 2
    set_seed(seed)
    model = mlp(widths)
    ms = stage_ms / len(x)
    stages = [TimedStage(nn.Sequential(*s, SimulatedKernel(ms))).to(d)
              for s, d in zip(split_model(model, default_split_points(model, 2)), devs)]
    for s in stages:
        s.reset()
        s.t0 = stages[0].t0  # one process, one clock
    h = stages[0](x.to(devs[0]))  # stage 0 works, stage 1 waits
    out = stages[1](h.to(devs[1]))  # the activation crosses to device 1; now stage 0 waits
    loss = F.cross_entropy(out, y.to(devs[1]))  # targets live where the logits are
    loss.backward()  # gradient flows back across the boundary (autograd moves it to devs[0])
    ref = reference_step(widths, x, y, 0.1, seed)
    grad_diff = max((p.grad.cpu() - g).abs().max().item() for p, g in zip(model.parameters(), ref["grads"]))
    events = [s.events for s in stages]
    ivs = sorted((e[2], e[3]) for evs in events for e in evs)
    overlap = sum(max(0.0, min(a[1], b[1]) - b[0]) for a, b in zip(ivs, ivs[1:]))
    return {"devices": [str(d) for d in devs], "simulated": not two_gpus, "events": events,
            "overlap_s": overlap, "idle_fraction": measured_bubble(events)["bubble"],
            "loss_diff": abs(loss.item() - ref["loss"]), "grad_diff": grad_diff}


def build_stage(args, pp_rank: int, ms_per_sample: float, device) -> tuple[TimedStage, torch.optim.Optimizer]:
    """This rank's stage of the seed-initialised model (+ the simulated kernel), timed, with its SGD."""
    set_seed(args.seed)  # every rank builds the whole model from the same seed, keeps its own slice
    model = mlp(args.widths)
    stage = split_model(model, args.split_points)[pp_rank]
    timed = TimedStage(nn.Sequential(*stage, SimulatedKernel(ms_per_sample))).to(device)
    return timed, torch.optim.SGD(timed.parameters(), lr=args.lr)


def pipeline_step(schedule: str, args, info, x, y, m: int, ms_per_sample: float) -> dict:
    """One training step of this rank's stage under `schedule` with m micro-batches; what this stage saw."""
    pp_rank, pp_world_size = info.rank, info.world_size
    pp_is_first_stage, pp_is_last_stage = pp_rank == 0, pp_rank == pp_world_size - 1
    timed, opt = build_stage(args, pp_rank, ms_per_sample, info.device)
    sizes = microbatch_sizes(len(x), m)
    first_linear = next(mod for mod in timed.module if isinstance(mod, nn.Linear))
    if schedule in ("gpipe", "1f1b"):
        order = gpipe_order(m) if schedule == "gpipe" else one_f_one_b_order(m, pp_world_size, pp_rank)

        def step():
            res = run_pipeline_step(timed, order, pp_rank=pp_rank, pp_world_size=pp_world_size, sizes=sizes,
                                    recv_shape=(first_linear.in_features,),
                                    inputs=list(x.split(sizes)) if pp_is_first_stage else [],
                                    targets=list(y.split(sizes)) if pp_is_last_stage else [],
                                    loss_fn=F.cross_entropy, device=info.device)
            return res.loss, res.peak_activation_bytes
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        stage = PipelineStage(timed, pp_rank, pp_world_size, info.device)
        cls = ScheduleGPipe if schedule == "torch-gpipe" else Schedule1F1B
        # Mean loss per micro-batch; the schedule divides the summed gradients by m (scale_grads=True), which is
        # the full-batch mean only when the micro-batches are equal -- hence m must divide N here.
        sched = cls(stage, m, loss_fn=F.cross_entropy)
        xd, yd = x.to(info.device), y.to(info.device)

        def step():
            losses: list = []
            if pp_is_first_stage and pp_is_last_stage:
                sched.step(xd, target=yd, losses=losses)
            elif pp_is_first_stage:
                sched.step(xd)
            elif pp_is_last_stage:
                sched.step(target=yd, losses=losses)
            else:
                sched.step()
            return (torch.stack(losses).mean().item() if pp_is_last_stage else None), None

    # Warm-up step with the simulated kernel off, then clear the gradients. In torch 2.13 the first step of a
    # PipelineStage also runs a forward (and backward) on placeholder tensors to infer shapes; the warm-up keeps
    # that, and first-message connection setup, out of the recorded step.
    kernel = timed.module[-1]
    kernel.ms_per_sample, ms = 0.0, kernel.ms_per_sample
    step()
    timed.zero_grad(set_to_none=True)
    kernel.ms_per_sample = ms
    barrier(info)
    timed.reset()  # time zero just after the barrier, on every rank
    loss, peak_bytes = step()
    events = list(timed.events)
    grads = [p.grad.detach().cpu().clone() for p in timed.parameters()]
    opt.step()
    return {"loss": loss, "events": events, "grads": grads, "peak_bytes": peak_bytes,
            "params": [p.detach().cpu().clone() for p in timed.parameters()]}


def theory_speedup(p: int, m: int) -> float:
    """Step time with m=1 over step time with m micro-batches, for p equal stages: p / ((m+p-1)/m).

    A step takes (m+p-1) slots of 1/m of the batch's per-stage work: m=1 -> p units, m=4, p=2 -> 5/4 units."""
    return p / ((m + p - 1) / m)


def peak_live(events) -> int:
    """Most micro-batches held at once on one stage: +1 when a forward ends, -1 when its backward ends."""
    live = peak = 0
    for kind, _, _, end in sorted(events, key=lambda e: e[3]):
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def benchmark(args, info) -> dict:
    """Real compute, no sleep: hand-written GPipe with m=1 and m=4 on 4 Linear(W, W) split over the ranks."""
    W = args.bench_width
    widths = [W] * 5
    set_seed(args.seed)
    model = mlp(widths)
    points = default_split_points(model, info.world_size)
    stage = TimedStage(split_model(model, points)[info.rank]).to(info.device)
    x, y = make_data(widths, args.bench_batch, args.seed)
    out = {}
    for m in (1, 4):
        sizes = microbatch_sizes(len(x), m)
        times, bubbles = [], []
        for step in range(args.bench_steps + 1):  # step 0 warms up (allocations, first send on each pair)
            stage.zero_grad(set_to_none=True)
            barrier(info)
            stage.reset()
            t0 = time.perf_counter()
            run_pipeline_step(stage, gpipe_order(m), pp_rank=info.rank, pp_world_size=info.world_size,
                              sizes=sizes, recv_shape=(W,), inputs=list(x.split(sizes)),
                              targets=list(y.split(sizes)), loss_fn=F.cross_entropy, device=info.device)
            barrier(info)
            dt = time.perf_counter() - t0
            ev = gather_to_rank0(stage.events, info)
            if step and info.master_process:
                times.append(dt)
                bubbles.append(measured_bubble(ev)["bubble"])
        if info.master_process:
            out[m] = {"step_s": statistics.median(times), "bubble": statistics.median(bubbles)}
    return out


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        pp_rank, pp_world_size = info.rank, info.world_size
        N = args.batch_size
        x, y = make_data(args.widths, N, args.seed)
        ms_per_sample = args.stage_ms / N
        results: dict = {"world_size": pp_world_size, "backend": info.backend, "device": info.device.type,
                         "widths": args.widths, "batch_size": N, "split_points": args.split_points,
                         "stage_ms": args.stage_ms}
        print0(f"model mlp({args.widths}), {len(mlp(args.widths))} modules, cut at {args.split_points} into "
               f"{pp_world_size} stage(s); batch {N}; world_size {pp_world_size} backend {info.backend or 'none'} "
               f"device {info.device.type}")

        # 1. The naive split, in one process (rank 0 only; the other ranks wait at the barrier).
        if info.master_process:
            # Under torchrun cuda:1 belongs to rank 1: use two GPUs for the naive split only in a plain run.
            naive = naive_split(args.widths, x, y, args.stage_ms, args.seed,
                                want_cuda=info.device.type == "cuda" and not info.distributed)
            results["naive"] = naive
            print0(f"naive split: stage 0 on {naive['devices'][0]}, stage 1 on {naive['devices'][1]}"
                   f"{' (simulated: both on the CPU)' if naive['simulated'] else ''}")
            print0(f"naive split: loss and gradients equal the unsplit model's: "
                   f"{max(naive['loss_diff'], naive['grad_diff']) < 1e-5}; "
                   f"the two devices ever busy at the same time: {naive['overlap_s'] > 1e-4}")
            print0(f"[perf] naive split: idle fraction of the two devices {naive['idle_fraction']:.3f} "
                   f"(theory {theory_bubble(2, 1):.3f})")
        barrier(info)

        # 2. The pipelines: one stage per rank, every schedule and m, checked against the unsplit model.
        ref = reference_step(args.widths, x, y, args.lr, args.seed) if info.master_process else None
        rows = []
        print0(f"{'schedule':<12}{'m':>3}{'loss':>10}{'|dloss|':>9}{'max|dgrad|':>12}{'max|dparam|':>13}"
               f"{'theory bubble':>15}  peak live micro-batches per stage")
        for schedule in args.schedules:
            for m in args.microbatches:
                if schedule.startswith("torch") and N % m:
                    print0(f"{schedule:<12}{m:>3}  skipped: torch.distributed.pipelining needs m to divide N={N}")
                    continue
                if schedule == "torch-1f1b" and m < pp_world_size:
                    print0(f"{schedule:<12}{m:>3}  skipped: Schedule1F1B needs m >= p = {pp_world_size}")
                    continue
                if schedule.startswith("torch") and not info.distributed:
                    print0(f"{schedule:<12}{m:>3}  skipped: needs a process group (run under torchrun)")
                    continue
                mine = pipeline_step(schedule, args, info, x, y, m, ms_per_sample)
                got = gather_to_rank0(mine, info)
                if not info.master_process:
                    continue
                loss = got[-1]["loss"]
                grads = [g for r in got for g in r["grads"]]
                params = [p for r in got for p in r["params"]]
                row = {"schedule": schedule, "m": m, "loss": loss, "loss_diff": abs(loss - ref["loss"]),
                       "grad_diff": max((a - b).abs().max().item() for a, b in zip(grads, ref["grads"])),
                       "param_diff": max((a - b).abs().max().item() for a, b in zip(params, ref["params"])),
                       "n_params": len(params) == len(ref["params"]),
                       "theory_bubble": theory_bubble(pp_world_size, m),
                       "events": [r["events"] for r in got],
                       "peak_live": [peak_live(r["events"]) for r in got],
                       "peak_activation_bytes": [r["peak_bytes"] for r in got]}
                row.update(measured_bubble(row["events"]))
                rows.append(row)
                print0(f"{schedule:<12}{m:>3}{loss:>10.6f}{row['loss_diff']:>9.1e}{row['grad_diff']:>12.1e}"
                       f"{row['param_diff']:>13.1e}{row['theory_bubble']:>15.3f}  {row['peak_live']}")
        results["rows"] = rows
        if info.master_process and rows:
            worst = max(max(r["loss_diff"], r["grad_diff"], r["param_diff"]) for r in rows)
            print0(f"every pipelined step equals the unsplit model (loss, gradients, parameters after SGD) "
                   f"within 1e-5: {worst < 1e-5}")
            for r in rows:
                print0(f"[perf] {r['schedule']:<12} m={r['m']}: measured bubble {r['bubble']:.3f} "
                       f"(theory {r['theory_bubble']:.3f}), step span {1e3 * r['span_s']:.0f} ms")
            spans = {r["m"]: r["span_s"] for r in rows if r["schedule"] == rows[0]["schedule"]}
            if 1 in spans and 4 in spans and args.stage_ms > 0:
                results["simulated_ratio_m4"] = spans[1] / spans[4]
                print0(f"[perf] {rows[0]['schedule']} with the simulated kernel: step m=1 / step m=4 = "
                       f"{spans[1] / spans[4]:.2f} (theory {theory_speedup(pp_world_size, 4):.2f})")
            for r in rows:
                if r["peak_activation_bytes"][0] is not None:
                    kib = ", ".join(f"{b / 1024:.1f}" for b in r["peak_activation_bytes"])
                    print0(f"activations held at peak, {r['schedule']:<5} m={r['m']}: {kib} KiB per stage")

        # 3. Uneven micro-batches, hand-written GPipe: weight each micro-batch's mean loss by n_i / N.
        n_u, m_u = args.uneven
        xu, yu = make_data(args.widths, n_u, args.seed + 7)
        got = gather_to_rank0(pipeline_step("gpipe", args, info, xu, yu, m_u, 0.0), info)
        if info.master_process:
            ref_u = reference_step(args.widths, xu, yu, args.lr, args.seed)
            grads = [g for r in got for g in r["grads"]]
            results["uneven"] = {"n": n_u, "m": m_u, "sizes": microbatch_sizes(n_u, m_u), "loss": got[-1]["loss"],
                                 "loss_diff": abs(got[-1]["loss"] - ref_u["loss"]),
                                 "grad_diff": max((a - b).abs().max().item() for a, b in zip(grads, ref_u["grads"]))}
            u = results["uneven"]
            print0(f"uneven: {n_u} samples into {m_u} micro-batches of {u['sizes']}: loss {u['loss']:.6f}, "
                   f"unsplit {ref_u['loss']:.6f}, |dloss| {u['loss_diff']:.1e}, max|dgrad| {u['grad_diff']:.1e}")

        # 4. Benchmark: real compute, m=4 against m=1.
        if args.bench_steps and info.distributed:
            bench = benchmark(args, info)
            if info.master_process:
                ratio = bench[1]["step_s"] / bench[4]["step_s"]
                theory = theory_speedup(pp_world_size, 4)
                results["bench"] = {"step_s_m1": bench[1]["step_s"], "step_s_m4": bench[4]["step_s"],
                                    "ratio": ratio, "theory_ratio": theory, "bubble_m1": bench[1]["bubble"],
                                    "bubble_m4": bench[4]["bubble"], "width": args.bench_width,
                                    "batch": args.bench_batch}
                print0(f"[perf] benchmark (real compute, {pp_world_size} stages, 4 x Linear({args.bench_width}, "
                       f"{args.bench_width}), batch {args.bench_batch}): step m=1 {1e3 * bench[1]['step_s']:.0f} ms, "
                       f"m=4 {1e3 * bench[4]['step_s']:.0f} ms, speed-up {ratio:.2f} (theory {theory:.2f}); "
                       f"bubble m=1 {bench[1]['bubble']:.3f}, m=4 {bench[4]['bubble']:.3f}")
        write_results(args.results, results, info)


if __name__ == "__main__":
    run_main(main)
