"""Lesson 17: where the time goes: a profile of DDP steps, then each knob counted against the default.

    python lessons/17_performance.py                                         # one process: no all-reduce
    torchrun --standalone --nproc_per_node=2 lessons/17_performance.py --trace-dir traces   # traces/*.json
    torchrun --standalone --nproc_per_node=2 lessons/17_performance.py --compile-backend inductor  # compiles
    python benchmarks/ddp_knobs.py    # each knob's step time / the default's, spread, weak-scaling efficiency

What to look for (ResidualMLP of lessons 07 and 08: 545,546 fp32 parameters, 2.2 MB of gradient per step):
1. `profile_steps`, the code to copy: torch.profiler around a few steps, each phase in a record_function
   range, a chrome trace per rank (https://ui.perfetto.dev): each bucket's all-reduce (on gloo's thread)
   against the backward compute. The all-reduces per step equal the buckets (claim); the fraction of
   all-reduce time hidden behind backward is timing ([perf]). One bucket hides nothing: it is issued when
   the last gradient is ready (a --bucket-cap-mb that gives one bucket shows only that). With several, the
   first goes out while backward still has nodes to run: one node left is all overlap needs.
2. The knobs, counted: bucket_cap_mb sets the buckets (DDP's rule, predicted: the default None has a 1 MiB
   first bucket, an explicit cap none); without find_unused_parameters every new DDP's first backward uses one
   bucket, rebuilt after it, and static_graph rebuilds one step later ([1, 1, 2, 2]); with
   find_unused_parameters=True alone DDP starts with the capped buckets and never rebuilds them (reducer.hpp);
   gradient_as_bucket_view saves one gradient copy; no_sync sends one round per optimizer step (lesson 07).
   What a comm hook can do to the bytes (fp16, bf16, PowerSGD) is lesson 18.
3. torch.compile of the DDP model: DDPOptimizer cuts the graph where DDP's buckets end, always with a 1 MiB
   first bucket (graphs = buckets for bucket_cap_mb None or 1; an explicit 25 gives 2 graphs for 1 bucket;
   below 1 it raises AssertionError), so with an AOTAutograd backend (inductor) each bucket's backward ends
   early enough to overlap (optimize_ddp=False: one graph, whose backward ends all at once); the default
   counting backend only counts graphs ([perf]: compile time).
Step times here are single samples ([perf]); the benchmark gives the spread, the input side and weak scaling.
Sources: pytorch.org/docs/stable/{notes/ddp,profiler}.html; DDP (Li et al., arXiv 2006.15704).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from common.data import digits_split
from common.data_parallel.micro_batches import micro_batch_stream, no_sync_unless
from common.harness.env import DistInfo, LessonError
from common.harness.ranks import gather_to_rank0, print0
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main, set_seed
from common.measure.counters import count_collectives
from common.measure.profiling import load_trace, step_profiles, summarize
from common.models import ResidualMLP
from common.performance.buckets import (
    allreduces_per_backward,
    gradient_storage_bytes,
    predicted_buckets,
)
from common.performance.compile_graphs import compiled_graphs, graphs_by_cap, refusal_below_1mib

CAPS_MB = (None, 0.1, 1.0, 25.0, 100.0)  # bucket_cap_mb sweep; None is DDP's default
ONE_BUCKET_MB = 100.0  # >= 2.2 MB of gradient: one bucket


@dataclass
class Run:
    """What every section shares: the options, this rank, the report, the model (`raw`, wrapped
    afresh by each measurement) and its initial weights, this rank's stream of micro-batches, its
    first batch x (batch, 1, 8, 8), y (batch,), and the bytes of one step's gradient."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    raw: torch.nn.Module
    init_state: dict
    stream: Iterator
    batch: tuple
    param_bytes: int


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--batch", type=int, default=32, help="samples per process per step (default 32)"
    )
    p.add_argument(
        "--profile-steps", type=int, default=3, help="profiled steps after 2 warm-up steps"
    )
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9")
    p.add_argument(
        "--bucket-cap-mb", type=float, default=1.0, help="buckets of the profile (1.0: 3 buckets)"
    )
    p.add_argument(
        "--trace-dir", default=None, help="write the chrome traces here (default: a temp folder)"
    )
    p.add_argument(
        "--compile-backend",
        choices=["eager", "inductor", "none"],
        default="eager",
        help="section 3: eager counts graphs in seconds; inductor compiles (minutes on CPU)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--data", default=None, help="digits .npz (default: the bundled data/digits.npz)"
    )
    p.add_argument(
        "--results", default=None, help="rank 0 writes the reported numbers here as JSON"
    )
    add_distributed_args(p)
    args = p.parse_args(argv)
    if min(args.batch, args.profile_steps) < 1 or min(args.lr, args.bucket_cap_mb) <= 0:
        raise LessonError(
            "--batch and --profile-steps must be >= 1, --lr and --bucket-cap-mb positive; got "
            f"--batch {args.batch} --profile-steps {args.profile_steps}"
        )
    return args


# ---------------------------------------------------------------------- 1. the profile (to copy)
def profile_steps(model, opt, batches, trace_path: Path, warmup: int = 2) -> None:
    """One training step per (x, y); the steps after `warmup` are profiled into the chrome trace."""
    cuda = next(model.parameters()).is_cuda
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # the warm-up steps are not recorded (DDP rebuilds its buckets after step 1; the profiler warms up last)
    when = schedule(wait=warmup - 1, warmup=1, active=len(batches) - warmup, repeat=1)

    def write_trace(prof) -> None:
        prof.export_chrome_trace(str(trace_path))

    with profile(activities=activities, schedule=when, on_trace_ready=write_trace) as prof:
        for x, y in batches:
            with record_function("forward"):
                loss = F.cross_entropy(model(x), y)
            with record_function("backward"):
                loss.backward()  # DDP all-reduces each bucket as soon as its last gradient is ready
            with record_function("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()  # the step's kernels end inside its own span of the trace
            prof.step()


def wrap(raw_model, info, **ddp_kwargs):
    """DDP with DDP's own defaults unless a knob says otherwise; a CUDA model names its device."""
    return DDP(
        raw_model,
        device_ids=info.device_ids,
        **ddp_kwargs,
    )


def profile_one(run: Run, trace_path: Path, cap) -> tuple:
    """Profile 2 + args.profile_steps steps of a fresh DDP (no DDP in one process) with `cap`; rank 0
    gets every rank's {"summary", "steps"} read back from its own trace."""
    run.raw.load_state_dict(run.init_state)
    model = wrap(run.raw, run.info, bucket_cap_mb=cap) if run.info.distributed else run.raw
    opt = torch.optim.SGD(run.raw.parameters(), lr=run.args.lr, momentum=0.9)
    batches = [
        tuple(t.to(run.info.device) for t in next(run.stream))
        for _ in range(2 + run.args.profile_steps)
    ]
    profile_steps(model, opt, batches, trace_path)
    steps = step_profiles(load_trace(trace_path))
    mine = {"summary": summarize(steps), "steps": [s.to_dict() for s in steps]}
    return gather_to_rank0(mine, run.info), (
        predicted_buckets(model) if run.info.distributed else 0
    )


def report_profile(cap, per_rank: list, buckets: int, report) -> None:
    """Rank 0: the all-reduces each rank's trace shows per step, against the buckets; the timings."""
    counts = [n for r in per_rank for n in r["summary"]["allreduces_per_step"]]
    report.claim(
        f"profile_allreduces_equal_buckets_cap_{cap:g}mb",
        max(abs(n - buckets) for n in counts),
        "==",
        0,
        "  bucket_cap_mb {cap:g}: {buckets} bucket(s), all-reduces per rank and step {counts}: "
        "off by {value}",
        cap=cap,
        buckets=buckets,
        counts=counts,
    )
    for r, prof in enumerate(per_rank):
        s = prof["summary"]
        report.perf(
            f"hidden_fraction_cap_{cap:g}mb_rank{r}",
            s["hidden_fraction"],
            "  rank {r}, {buckets} bucket(s): {value:.2f} of {all:.1f} ms all-reduce hidden "
            "({exposed:.1f} ms exposed); step {step:.1f} ms, backward {backward:.1f} ms",
            r=r,
            buckets=buckets,
            all=s["allreduce_ms"],
            exposed=s["exposed_ms"],
            step=s["step_ms"],
            backward=s["backward_ms"],
        )


def profile_section(run: Run, trace_dir: Path) -> None:
    print0(f"\n1. the profile: {run.args.profile_steps} steps per rank after 2 warm-up steps")
    profiles, after, buckets_of, nodes_of = {}, {}, {}, {}
    caps = (
        dict.fromkeys((run.args.bucket_cap_mb, ONE_BUCKET_MB)) if run.info.distributed else (None,)
    )
    for cap in caps:
        name = f"trace_rank{run.info.rank}" + (f"_bucket_cap_{cap:g}mb" if cap else "") + ".json"
        per_rank, buckets = profile_one(run, trace_dir / name, cap)
        profiles[str(cap)] = per_rank
        if not run.info.master_process:
            continue
        if cap is None:
            step_ms = per_rank[0]["summary"]["step_ms"]
            run.report.perf("profile_step_ms", step_ms, "step {value:.1f} ms, no all-reduce")
            continue
        report_profile(cap, per_rank, buckets, run.report)
        buckets_of[cap] = buckets
        after[cap] = [n for r in per_rank for n in r["summary"]["ops_after_first_issue"]]
        nodes_of[cap] = max(st["backward_ops"] for r in per_rank for st in r["steps"])  # per step
    if run.info.distributed and run.info.master_process:
        overlap_claims(run.args.bucket_cap_mb, buckets_of, after, nodes_of, run.report)
    run.report.record("timeline", profiles if run.info.master_process else None)
    run.report.value(
        "trace_files",
        sorted(p.name for p in trace_dir.glob(f"trace_rank{run.info.rank}*.json")),
        "  chrome traces of rank 0 (one per setting): {value}",
    )


def overlap_claims(cap: float, buckets_of: dict, after: dict, nodes_of: dict, report) -> None:
    """What the traces show about overlap, each claim where its bucket count says it applies."""
    if buckets_of[cap] > 1:  # the bound: one node still to run is all overlap needs
        report.claim(
            "backward_nodes_after_first_bucket_issued",
            min(after[cap]),
            ">=",
            1,
            "  {buckets} buckets: the first all-reduce goes out with {value} of {nodes} backward nodes "
            "still to run",
            buckets=buckets_of[cap],
            nodes=nodes_of[cap],
        )
    else:  # e.g. --bucket-cap-mb 25 on this 2.2 MB model: nothing to claim about overlap
        print0(f"  bucket_cap_mb {cap:g} also gives one bucket: no overlap to show (1 gives 3)")
    ones = [n for c, counts in after.items() if buckets_of[c] == 1 for n in counts]
    report.claim(
        "one_bucket_issued_after_last_node",
        max(ones),
        "==",
        0,
        "  one bucket: it is issued after the last autograd node started ({value} remain)",
    )


# ---------------------------------------------------------------------- 2. the knobs, each counted
def bucket_knobs(run: Run) -> dict:
    """bucket_cap_mb and static_graph: all-reduce calls of 4 backward passes, against DDP's rule."""
    rows_off, calls = 0, {}
    for cap in CAPS_MB:
        run.raw.load_state_dict(run.init_state)
        model = wrap(run.raw, run.info, bucket_cap_mb=cap)
        calls[cap], nbytes = allreduces_per_backward(model, run.batch)
        predicted = predicted_buckets(model)
        rows_off += calls[cap][-1] != predicted or nbytes != run.param_bytes
        run.report.value(
            f"calls_cap_{cap}",
            calls[cap],
            "  bucket_cap_mb {cap:>5}: calls {value}, predicted {predicted} bucket(s), {nbytes:,} bytes",
            cap=str(cap),
            predicted=predicted,
            nbytes=nbytes,
        )
        run.report.append(
            "knobs", {"knob": f"bucket_cap_mb={cap}", "calls": calls[cap][-1], "bytes": nbytes}
        )
    run.report.claim(
        "bucket_sweep_rows_off",
        rows_off,
        "==",
        0,
        "  rows off DDP's rule or the gradient's bytes: {value} (the default None has a 1 MiB first bucket)",
    )
    run.report.claim(
        "first_step_one_bucket",
        max(c[0] for c in calls.values()),
        "==",
        1,
        "  first backward of a new DDP: {value} bucket holding every gradient (rebuilt after it)",
    )
    run.raw.load_state_dict(run.init_state)
    static = allreduces_per_backward(wrap(run.raw, run.info, static_graph=True), run.batch)[0]
    run.report.value(
        "calls_static_graph",
        static,
        "  static_graph=True: calls {value}: the same buckets, rebuilt one step later",
    )
    late = sum(a != b for a, b in zip(static, [1, 1, *calls[None][2:]]))
    run.report.claim(
        "static_graph_rebuilds_one_step_later",
        late,
        "==",
        0,
        "  steps where static_graph's calls differ from [1, 1, default's from step 3]: {value}",
    )
    return calls


def knobs_section(run: Run) -> None:
    print0("\n2. the knobs, counted (all-reduce calls of backward passes 1..4; bytes of the last)")
    calls = bucket_knobs(run)
    saved = {}
    for view in (False, True):
        run.raw.load_state_dict(run.init_state)
        saved[view] = gradient_storage_bytes(
            wrap(run.raw, run.info, gradient_as_bucket_view=view), run.batch
        )
        run.raw.zero_grad(set_to_none=True)
    run.report.claim(
        "grad_as_bucket_view_saves_one_gradient_copy",
        saved[False] - saved[True],
        "==",
        run.param_bytes,
        "  gradient_as_bucket_view: .grad + buckets {without:,} -> {with_view:,} bytes, {value:,} saved",
        without=saved[False],
        with_view=saved[True],
    )
    run.raw.load_state_dict(run.init_state)
    model, k = wrap(run.raw, run.info), 4
    allreduces_per_backward(
        model, run.batch, steps=2
    )  # the counted hook; buckets rebuilt after step 1
    # lesson 07: no_sync around the forward AND backward of k - 1 micro-steps
    with count_collectives() as c:
        for micro_step in range(k):
            with no_sync_unless(model, last=micro_step == k - 1):
                (F.cross_entropy(model(run.batch[0]), run.batch[1]) / k).backward()
    run.report.claim(
        "no_sync_one_round_per_step",
        c.calls.get("all_reduce", 0),
        "==",
        calls[None][-1],
        "  no_sync in {skipped} of {k} micro-steps (lesson 07): {value} all-reduces per optimizer step, "
        "not {k} rounds",
        skipped=k - 1,
        k=k,
    )


# ---------------------------------------------------------------------- 3. torch.compile of DDP
def compile_section(run: Run) -> None:
    what = "DDP model, bucket_cap_mb 1:" if run.info.distributed else "model (no DDP):"
    print0(f"\n3. torch.compile (backend {run.args.compile_backend}) of the {what}")
    run.raw.load_state_dict(run.init_state)
    model = wrap(run.raw, run.info, bucket_cap_mb=1.0) if run.info.distributed else run.raw
    graphs, compile_s, step_s = compiled_graphs(model, run.batch, True, run.args.compile_backend)
    run.report.claim(
        "compiled_graphs_equal_buckets",
        graphs,
        "==",
        predicted_buckets(model) if run.info.distributed else 1,
        "  DDPOptimizer splits the forward into {value} graphs at bucket boundaries"
        if run.info.distributed
        else "  {value} graph: no DDP, nothing to split",
    )
    run.report.perf("compile_s", compile_s, "  first step (tracing + compiling) {value:.1f} s")
    run.report.perf("compiled_step_ms", 1e3 * step_s, "  second step {value:.1f} ms")
    if run.info.distributed:
        compile_rules(run, model)


def compile_rules(run: Run, model: DDP) -> None:
    """Where DDPOptimizer cuts, against DDP's own buckets, and the cap it refuses."""
    one = compiled_graphs(model, run.batch, False, run.args.compile_backend)[0]
    run.report.claim(
        "compile_without_ddp_optimizer_one_graph",
        one,
        "==",
        1,
        "  optimize_ddp=False: {value} graph, whose backward ends all at once (with AOTAutograd)",
    )

    def make_ddp(cap):
        run.raw.load_state_dict(run.init_state)
        return wrap(run.raw, run.info, bucket_cap_mb=cap)

    # eager counting: the split does not depend on the backend
    rows = graphs_by_cap(make_ddp, run.batch)
    run.report.value(
        "compiled_graphs_by_cap",
        rows,
        "  bucket_cap_mb: graphs / DDP's buckets: {pairs}",
        pairs=", ".join(f"{cap} {g} / {b}" for cap, (g, b, _) in rows.items()),
    )
    run.report.claim(
        "compiled_graphs_follow_1mib_first_bucket",
        sum(g != r for g, _, r in rows.values()),
        "==",
        0,
        "  caps where graphs differ from DDP's rule with a 1 MiB first bucket: {value}",
    )
    message = refusal_below_1mib(make_ddp(0.5), run.batch)
    run.report.claim(
        "compile_refuses_bucket_cap_below_1mb",
        int(message.startswith("First bucket should be")),
        "==",
        1,
        "  bucket_cap_mb 0.5: AssertionError({head!r}...) from compile: {value}",
        head=message[:36],
    )


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info, tempfile.TemporaryDirectory() as tmp:
        report = Report(info)
        train_set, _ = digits_split(path=args.data)  # (1438, 1, 8, 8), every rank
        set_seed(args.seed)
        raw = ResidualMLP().to(info.device)
        init_state = {k: v.clone() for k, v in raw.state_dict().items()}
        param_bytes = report.value(
            "param_bytes",
            sum(p.numel() * p.element_size() for p in raw.parameters()),
            "ResidualMLP (width 256, depth 4): {value:,} bytes of fp32 gradient per step",
        )
        stream = micro_batch_stream(train_set, args.batch, info.world_size, info.rank, args.seed)
        # x (batch, 1, 8, 8), y (batch,): this rank's
        batch = tuple(t.to(info.device) for t in next(stream))
        report.record("world_size", info.world_size)
        report.record("batch_per_process", args.batch)
        report.record("knobs", [])
        trace_dir = Path(args.trace_dir or tmp)
        trace_dir.mkdir(parents=True, exist_ok=True)
        run = Run(args, info, report, raw, init_state, stream, batch, param_bytes)
        profile_section(run, trace_dir)
        if info.distributed:
            knobs_section(run)
        if args.compile_backend != "none":
            compile_section(run)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
