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
   the last gradient is ready (a --bucket-cap-mb that gives one bucket shows only that).
2. The knobs, counted: bucket_cap_mb sets the buckets (DDP's rule, predicted: the default None has a 1 MiB
   first bucket, an explicit cap none); without find_unused_parameters every new DDP's first backward uses one
   bucket, rebuilt after it, and static_graph rebuilds one step later ([1, 1, 2, 2]); with
   find_unused_parameters=True alone DDP starts with the capped buckets and never rebuilds them (reducer.hpp);
   gradient_as_bucket_view saves one gradient copy; no_sync sends one round per optimizer step (lesson 07);
   fp16/bf16 hooks halve the bytes exactly, PowerSGD rank 1 cuts them ~78x; accuracy per hook over seeds 0-11.
   A PowerSGD hook's state is training state: `save_powersgd` / `resume_powersgd` resume a run exactly
   (0.0 from the uninterrupted one), model + optimizer alone or the docs' pickled state do not (measured).
3. torch.compile of the DDP model: DDPOptimizer cuts the graph where DDP's buckets end, always with a 1 MiB
   first bucket (graphs = buckets for bucket_cap_mb None or 1; an explicit 25 gives 2 graphs for 1 bucket;
   below 1 it raises AssertionError), so with an AOTAutograd backend (inductor) each bucket's backward ends
   early enough to overlap; the default counting backend only counts graphs ([perf]: compile time).
Step times here are single samples ([perf]); the benchmark gives the spread, the input side and weak scaling.
Sources: pytorch.org/docs/stable/{notes/ddp,ddp_comm_hooks,profiler}.html; DDP (Li et al., arXiv 2006.15704);
PowerSGD (Vogels et al., arXiv 1905.13727); torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py.
"""

from __future__ import annotations

import argparse
import copy
import pickle
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from common.data import digits_split
from common.harness.env import LessonError
from common.harness.metrics import evaluate
from common.harness.ranks import gather_to_rank0, print0
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main, set_seed
from common.measure.counters import count_collectives
from common.measure.memory import ResidualMLP, micro_batch_stream, no_sync_unless
from common.measure.precision import max_diff, worst_over_ranks
from common.measure.profiling import load_trace, step_profiles, summarize
from common.performance.comm_hooks import (
    HOOKS,
    allreduces_per_backward,
    comm_hook,
    gradient_storage_bytes,
    plain_until_switched,
    predicted_buckets,
)
from common.performance.compile_graphs import compiled_graphs, graphs_by_cap, refusal_below_1mib

CAPS_MB = (None, 0.1, 1.0, 25.0, 100.0)  # bucket_cap_mb sweep; None is DDP's default
ONE_BUCKET_MB = (
    100.0  # >= 2.2 MB of gradient: one bucket (PowerSGD under gloo needs it: common/comm_hooks)
)
RESUME_STEPS, RESUME_AT = 12, 6  # section 2's PowerSGD run, checkpointed after step 6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--batch", type=int, default=32, help="samples per process per step (default 32)"
    )
    p.add_argument(
        "--steps", type=int, default=40, help="SGD steps of each comm-hook run (default 40)"
    )
    p.add_argument(
        "--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9 (default 0.05)"
    )
    p.add_argument(
        "--profile-steps", type=int, default=3, help="profiled steps after 2 warm-up steps"
    )
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
    if (
        min(args.batch, args.profile_steps) < 1
        or args.steps < 3
        or min(args.lr, args.bucket_cap_mb) <= 0
    ):
        raise LessonError(
            "--batch, --profile-steps, --lr and --bucket-cap-mb must be positive and --steps "
            f">= 3 (PowerSGD compresses from step 3 on); got --steps {args.steps}"
        )
    return args


# ---------------------------------------------------------------------- 1. the profile (to copy)
def profile_steps(model, opt, batches, trace_path: Path, warmup: int = 2) -> None:
    """One training step per (x, y); the steps after `warmup` are profiled into the chrome trace."""
    cuda = next(model.parameters()).is_cuda
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # the warm-up steps are not recorded (DDP rebuilds its buckets after step 1; the profiler warms up last)
    when = schedule(wait=warmup - 1, warmup=1, active=len(batches) - warmup, repeat=1)
    with profile(
        activities=activities,
        schedule=when,
        on_trace_ready=lambda p: p.export_chrome_trace(str(trace_path)),
    ) as prof:
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
        device_ids=[info.local_rank] if info.device.type == "cuda" else None,
        **ddp_kwargs,
    )


def profile_section(raw, init_state, stream, trace_dir: Path, args, info, report) -> None:
    print0(f"\n1. the profile: {args.profile_steps} steps per rank after 2 warm-up steps")
    profiles, after, buckets_of, nodes_of = {}, {}, {}, {}
    for cap in dict.fromkeys((args.bucket_cap_mb, ONE_BUCKET_MB)) if info.distributed else (None,):
        raw.load_state_dict(init_state)
        model = wrap(raw, info, bucket_cap_mb=cap) if info.distributed else raw
        opt = torch.optim.SGD(raw.parameters(), lr=args.lr, momentum=0.9)
        name = f"trace_rank{info.rank}" + (f"_bucket_cap_{cap:g}mb" if cap else "") + ".json"
        batches = [
            tuple(t.to(info.device) for t in next(stream)) for _ in range(2 + args.profile_steps)
        ]
        profile_steps(model, opt, batches, trace_dir / name)
        steps = step_profiles(load_trace(trace_dir / name))
        per_rank = gather_to_rank0(
            {"summary": summarize(steps), "steps": [s.to_dict() for s in steps]}, info
        )
        profiles[str(cap)] = per_rank
        if not info.master_process:
            continue
        if cap is None:
            report.perf(
                "profile_step_ms",
                per_rank[0]["summary"]["step_ms"],
                "step {value:.1f} ms, no all-reduce",
            )
            continue
        buckets = buckets_of[cap] = predicted_buckets(model)
        counts = [n for r in per_rank for n in r["summary"]["allreduces_per_step"]]
        report.claim(
            f"profile_allreduces_equal_buckets_cap_{cap:g}mb",
            max(abs(n - buckets) for n in counts),
            "==",
            0,
            f"  bucket_cap_mb {cap:g}: {buckets} bucket(s); the trace shows {counts} "
            "all-reduces (ranks x steps): max |count - buckets| = {value}",
        )
        after[cap] = [n for r in per_rank for n in r["summary"]["ops_after_first_issue"]]
        nodes_of[cap] = max(st["backward_ops"] for r in per_rank for st in r["steps"])  # per step
        for r, prof in enumerate(per_rank):
            s = prof["summary"]
            report.perf(
                f"hidden_fraction_cap_{cap:g}mb_rank{r}",
                s["hidden_fraction"],
                f"  rank {r}, {buckets} bucket(s): {{value:.2f}} of {s['allreduce_ms']:.1f} ms of "
                f"all-reduce hidden behind backward ({s['exposed_ms']:.1f} ms exposed); step "
                f"{s['step_ms']:.1f} ms, backward {s['backward_ms']:.1f} ms",
            )
    if info.distributed and info.master_process:
        overlap_claims(args.bucket_cap_mb, buckets_of, after, nodes_of, report)
    report.record("timeline", profiles if info.master_process else None)
    report.value(
        "trace_files",
        sorted(p.name for p in trace_dir.glob(f"trace_rank{info.rank}*.json")),
        "  chrome traces, one per rank and setting (rank 0's): {value}",
    )


def overlap_claims(cap: float, buckets_of: dict, after: dict, nodes_of: dict, report) -> None:
    """What the traces show about overlap, each claim where its bucket count says it applies."""
    if buckets_of[cap] > 1:  # the bound: one node still to run is all overlap needs
        report.claim(
            "backward_nodes_after_first_bucket_issued",
            min(after[cap]),
            ">=",
            1,
            f"  {buckets_of[cap]} buckets: the first all-reduce is issued with {{value}} of the "
            f"{nodes_of[cap]} autograd nodes of backward still to run (fewest over ranks and "
            "steps): it can overlap them (1 would do)",
        )
    else:  # e.g. --bucket-cap-mb 25 on this 2.2 MB model: nothing to claim about overlap
        print0(
            f"  bucket_cap_mb {cap:g} also gives one bucket: no overlap to show (the default 1 gives 3)"
        )
    ones = [n for c, counts in after.items() if buckets_of[c] == 1 for n in counts]
    report.claim(
        "one_bucket_issued_after_last_node",
        max(ones),
        "==",
        0,
        "  one bucket: it is issued after the last autograd node started ({value} remain)",
    )


# ---------------------------------------------------------------------- 2. the knobs, each counted
def bucket_knobs(raw, init_state, batch, param_bytes: int, info, report) -> dict:
    """bucket_cap_mb and static_graph: all-reduce calls of 4 backward passes, against DDP's rule."""
    rows_off, calls = 0, {}
    for cap in CAPS_MB:
        raw.load_state_dict(init_state)
        model = wrap(raw, info, bucket_cap_mb=cap)
        calls[cap], nbytes = allreduces_per_backward(model, batch)
        rows_off += calls[cap][-1] != predicted_buckets(model) or nbytes != param_bytes
        report.value(
            f"calls_cap_{cap}",
            calls[cap],
            f"  bucket_cap_mb {str(cap):>5}: calls {{value}}, "
            f"predicted {predicted_buckets(model)} bucket(s), {nbytes:,} bytes",
        )
        report.results["knobs"].append(
            {"knob": f"bucket_cap_mb={cap}", "calls": calls[cap][-1], "bytes": nbytes}
        )
    report.claim(
        "bucket_sweep_rows_off",
        rows_off,
        "==",
        0,
        "  rows where calls != DDP's rule or bytes != "
        "the gradient's: {value} (None, the default, is NOT an explicit 25: 1 MiB first bucket)",
    )
    report.claim(
        "first_step_one_bucket",
        max(c[0] for c in calls.values()),
        "==",
        1,
        "  every first "
        "backward all-reduces {value} bucket holding all gradients; buckets are rebuilt in the order"
        " they arrived (not so with find_unused_parameters=True: capped buckets, never rebuilt)",
    )
    raw.load_state_dict(init_state)
    static = allreduces_per_backward(wrap(raw, info, static_graph=True), batch)[0]
    report.value(
        "calls_static_graph",
        static,
        "  static_graph=True: calls {value}: the same buckets, rebuilt one step later",
    )
    late = sum(a != b for a, b in zip(static, [1, 1, *calls[None][2:]]))
    report.claim(
        "static_graph_rebuilds_one_step_later",
        late,
        "==",
        0,
        "  steps where static_graph's calls differ from [1, 1, default's from step 3]: {value}",
    )
    return calls


def knobs_section(raw, init_state, batch, param_bytes: int, info, report) -> None:
    print0("\n2. the knobs, counted (all-reduce calls of backward passes 1..4; bytes of the last)")
    calls = bucket_knobs(raw, init_state, batch, param_bytes, info, report)
    saved = {}
    for view in (False, True):
        raw.load_state_dict(init_state)
        saved[view] = gradient_storage_bytes(wrap(raw, info, gradient_as_bucket_view=view), batch)
        raw.zero_grad(set_to_none=True)
    report.claim(
        "grad_as_bucket_view_saves_one_gradient_copy",
        saved[False] - saved[True],
        "==",
        param_bytes,
        f"  gradient_as_bucket_view: .grad + buckets hold {saved[True]:,} bytes instead of "
        f"{saved[False]:,}: {{value:,}} saved, one gradient copy",
    )
    raw.load_state_dict(init_state)
    model, k = wrap(raw, info), 4
    allreduces_per_backward(
        model, batch, steps=2
    )  # registers the counted hook; buckets rebuilt after step 1
    with (
        count_collectives() as c
    ):  # lesson 07: no_sync around the forward AND backward of k - 1 micro-steps
        for micro_step in range(k):
            with no_sync_unless(model, last=micro_step == k - 1):
                (F.cross_entropy(model(batch[0]), batch[1]) / k).backward()
    report.claim(
        "no_sync_one_round_per_step",
        c.calls.get("all_reduce", 0),
        "==",
        calls[None][-1],
        f"  no_sync for {k - 1} of {k} micro-steps (lesson 07): {{value}} all-reduces per optimizer "
        f"step, one round of buckets, not {k}",
    )


def train_with_hook(hook: str, init_state, train_set, test_set, args, info) -> dict:
    """`args.steps` SGD steps with `hook` from the same start: test accuracy, bytes of the last step, ms."""
    raw = ResidualMLP().to(info.device)
    raw.load_state_dict(init_state)
    model = wrap(raw, info, bucket_cap_mb=ONE_BUCKET_MB) if info.distributed else raw
    if info.distributed:
        hook_fn, state = comm_hook(hook, seed=args.seed)
        model.register_comm_hook(state, hook_fn)
    opt = torch.optim.SGD(raw.parameters(), lr=args.lr, momentum=0.9)
    stream = micro_batch_stream(train_set, args.batch, info.world_size, info.rank, args.seed)
    times, nbytes = [], 0
    for _ in range(args.steps):
        x, y = (t.to(info.device) for t in next(stream))  # x (batch, 1, 8, 8): this rank's shard
        t0 = time.perf_counter()
        with count_collectives() as c:
            F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        nbytes = c.bytes.get("all_reduce", 0)
    return {
        "hook": hook,
        "accuracy": evaluate(raw, test_set, info)["accuracy"],
        "bytes_per_step": nbytes,
        "step_ms": 1e3 * statistics.median(times),
    }


def hooks_section(init_state, train_set, test_set, args, info, report) -> None:
    print0(
        f"\n   {'comm hooks, one bucket' if info.distributed else 'one process'}, {args.steps} SGD steps "
        f"of {args.batch} x {info.world_size} samples:"
    )
    runs = {}
    for hook in HOOKS if info.distributed else HOOKS[:1]:
        runs[hook] = r = train_with_hook(hook, init_state, train_set, test_set, args, info)
        label = hook if info.distributed else "no DDP"  # one process: no hook, nothing to send
        report.value(
            f"accuracy_{hook}",
            r["accuracy"],
            f"  {label:<10} test accuracy {{value:.4f}}, "
            f"{r['bytes_per_step']:,} bytes all-reduced per step",
        )
        report.perf(
            f"step_ms_{hook}", r["step_ms"], f"  {label:<10} {{value:.1f}} ms per step (median)"
        )
        report.results["knobs"].append({"knob": f"comm_hook={hook}", "calls": None, **r})
    base = runs["allreduce"]  # the accuracy bounds: 2 ranks, seeds 0-11 (the lowest baseline 0.82)
    measured = (args.steps, args.batch, args.lr) == (
        40,
        32,
        0.05,
    )  # the setting those bounds come from
    if measured:
        report.claim(
            "default_hook_learns",
            base["accuracy"],
            ">=",
            0.8,
            "  baseline: test accuracy {value:.4f}",
        )
    else:
        print0(
            "  (the accuracy bounds hold for --steps 40 --batch 32 --lr 0.05: here recorded, not claimed)"
        )
    if not info.distributed:
        return
    for hook in ("fp16", "bf16"):
        report.claim(
            f"{hook}_hook_halves_bytes",
            base["bytes_per_step"] - 2 * runs[hook]["bytes_per_step"],
            "==",
            0,
            f"  {hook}: allreduce bytes - 2 x {hook} bytes = {{value}}: exactly half",
        )
    for rank in (1, 2, 4):
        ratio = base["bytes_per_step"] / runs[f"powersgd{rank}"]["bytes_per_step"]
        report.value(
            f"powersgd{rank}_bytes_ratio",
            ratio,
            f"  PowerSGD rank {rank}: {{value:.1f}}x fewer bytes per step",
        )
    report.claim(
        "powersgd1_cuts_bytes_10x",
        report.results["powersgd1_bytes_ratio"],
        ">=",
        10,
        "  PowerSGD rank 1 cuts the bytes by {value:.1f}x",
    )
    # Bounds from seeds 0-11 on 2 ranks (worst, mean): 16-bit rounding flipped no test prediction; after 40
    # steps PowerSGD lost (0.20, 0.11) at rank 1 and (0.09, 0.02) at rank 4: a short run pays, rank 1 most
    for hook, bound, worst in (
        (
            ("fp16", 0.02, 0.0),
            ("bf16", 0.02, 0.0),
            ("powersgd1", 0.22, 0.2006),
            ("powersgd4", 0.1, 0.0864),
        )
        if measured
        else ()
    ):
        report.claim(
            f"{hook}_accuracy_change",
            abs(runs[hook]["accuracy"] - base["accuracy"]),
            "<=",
            bound,
            f"  {hook}: |test accuracy - allreduce's| = {{value:.4f}} (seeds 0-11: up to {worst})",
        )


# ---------------------------------------------------------- 2b. a PowerSGD run resumed exactly (to copy)
def save_powersgd(raw, opt, state) -> dict:
    """A PowerSGD run's checkpoint, one per rank (the error feedback is each rank's own): model, optimizer,
    and the hook's state pickled. PowerSGDState.__getstate__ keeps all but the process group: error_dict
    (error feedback), p_memory_dict / q_memory_dict (warm start), rng (the seeds of Q), iter."""
    return {
        "model": copy.deepcopy(raw.state_dict()),
        "optimizer": copy.deepcopy(opt.state_dict()),
        "hook_state": pickle.dumps(state),
    }


def resume_powersgd(ckpt: dict, batch, args, info, hook_state: bool = True, rebuild: bool = True):
    """(raw model, DDP model, optimizer) resumed from `ckpt`. With `rebuild`, one backward whose gradients are
    thrown away runs first, the hook passing plain all-reduce, so that DDP rebuilds its bucket: a new DDP
    fills its first bucket in parameter order and rebuilds it after that backward in the order gradients
    arrived, and the saved error_dict, P and Q are flat tensors in the rebuilt order. Without it they are
    added to the wrong gradients for one step, and the run never comes back to the uninterrupted one."""
    raw = ResidualMLP().to(info.device)
    raw.load_state_dict(ckpt["model"])
    model = wrap(raw, info, bucket_cap_mb=ONE_BUCKET_MB)
    opt = torch.optim.SGD(raw.parameters(), lr=args.lr, momentum=0.9)
    opt.load_state_dict(
        copy.deepcopy(ckpt["optimizer"])
    )  # load_state_dict keeps (and updates) its tensors
    hook, state = comm_hook("powersgd1", seed=args.seed)
    if (
        hook_state
    ):  # the docs' way; its process group becomes the default group (set it if yours is not)
        state = pickle.loads(ckpt["hook_state"])
    resumed_hook, switch = plain_until_switched(hook)
    model.register_comm_hook(state, resumed_hook)
    if rebuild:  # this backward's gradients are thrown away; the hook's state is not touched
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        opt.zero_grad(set_to_none=True)
    switch()
    return raw, model, opt


def sgd_steps(model, opt, batches) -> None:
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def resume_section(init_state, train_set, args, info, report) -> None:
    print0(
        f"\n   PowerSGD rank 1 resumed after step {RESUME_AT} of {RESUME_STEPS} vs the uninterrupted run:"
    )
    stream = micro_batch_stream(train_set, args.batch, info.world_size, info.rank, args.seed)
    batches = [tuple(t.to(info.device) for t in next(stream)) for _ in range(RESUME_STEPS)]
    raw = ResidualMLP().to(info.device)
    raw.load_state_dict(init_state)
    model = wrap(raw, info, bucket_cap_mb=ONE_BUCKET_MB)
    hook, state = comm_hook("powersgd1", seed=args.seed)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(raw.parameters(), lr=args.lr, momentum=0.9)
    sgd_steps(model, opt, batches[:RESUME_AT])
    ckpt = save_powersgd(raw, opt, state)
    sgd_steps(model, opt, batches[RESUME_AT:])  # the uninterrupted run
    for name, kw, text in (
        ("model_and_optimizer", dict(hook_state=False, rebuild=False), "model + optimizer only"),
        ("pickled_hook_state", dict(rebuild=False), "+ the pickled PowerSGDState (the docs' way)"),
        ("exact", {}, "+ one pass-through backward first (buckets rebuilt)"),
    ):
        resumed, resumed_ddp, resumed_opt = resume_powersgd(
            ckpt, batches[RESUME_AT], args, info, **kw
        )
        sgd_steps(resumed_ddp, resumed_opt, batches[RESUME_AT:])
        diff = worst_over_ranks([max_diff(resumed.parameters(), raw.parameters())], info)[0]
        if name != "exact":
            report.value(
                f"powersgd_resume_{name}", diff, f"  {text:<52} max |difference| {{value:.1e}}"
            )
    report.claim(
        "powersgd_resume_exact", diff, "==", 0.0, f"  {text:<52} max |difference| {{value}}"
    )


# ---------------------------------------------------------------------- 3. torch.compile of DDP
def compile_section(raw, init_state, batch, args, info, report) -> None:
    print0(
        f"\n3. torch.compile (backend {args.compile_backend}) of the "
        + ("DDP model, bucket_cap_mb 1:" if info.distributed else "model (no DDP):")
    )
    raw.load_state_dict(init_state)
    model = wrap(raw, info, bucket_cap_mb=1.0) if info.distributed else raw
    graphs, compile_s, step_s = compiled_graphs(model, batch, True, args.compile_backend)
    report.claim(
        "compiled_graphs_equal_buckets",
        graphs,
        "==",
        predicted_buckets(model) if info.distributed else 1,
        "  DDPOptimizer splits the forward into {value} graphs at bucket boundaries"
        if info.distributed
        else "  {value} graph: no DDP, nothing to split",
    )
    report.perf("compile_s", compile_s, "  first step (tracing + compiling) {value:.1f} s")
    report.perf("compiled_step_ms", 1e3 * step_s, "  second step {value:.1f} ms")
    if not info.distributed:
        return
    one = compiled_graphs(model, batch, False, args.compile_backend)[0]
    report.claim(
        "compile_without_ddp_optimizer_one_graph",
        one,
        "==",
        1,
        "  optimize_ddp=False: {value} "
        "graph (with AOTAutograd its backward would end all at once: no bucket starts early)",
    )

    def make_ddp(cap):
        raw.load_state_dict(init_state)
        return wrap(raw, info, bucket_cap_mb=cap)

    rows = graphs_by_cap(
        make_ddp, batch
    )  # eager counting: the split does not depend on the backend
    report.value(
        "compiled_graphs_by_cap",
        rows,
        "  bucket_cap_mb: graphs / DDP's buckets: "
        + ", ".join(f"{cap} {g} / {b}" for cap, (g, b, _) in rows.items()),
    )
    off = sum(g != r for g, _, r in rows.values())
    report.claim(
        "compiled_graphs_follow_1mib_first_bucket",
        off,
        "==",
        0,
        "  caps where graphs != DDP's "
        "rule with a 1 MiB first bucket: {value} (DDP has that bucket only for None)",
    )
    message = refusal_below_1mib(make_ddp(0.5), batch)
    report.claim(
        "compile_refuses_bucket_cap_below_1mb",
        int(message.startswith("First bucket should be")),
        "==",
        1,
        f"  bucket_cap_mb 0.5: AssertionError({message[:36]!r}...) from compile: {{value}}",
    )


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info, tempfile.TemporaryDirectory() as tmp:
        report = Report(info)
        train_set, test_set = digits_split(
            path=args.data
        )  # (1438, 1, 8, 8) and (359, 1, 8, 8), every rank
        set_seed(args.seed)
        raw = ResidualMLP().to(info.device)
        init_state = {k: v.clone() for k, v in raw.state_dict().items()}
        param_bytes = report.value(
            "param_bytes",
            sum(p.numel() * p.element_size() for p in raw.parameters()),
            "ResidualMLP (width 256, depth 4): {value:,} bytes of fp32 gradient per step",
        )
        stream = micro_batch_stream(train_set, args.batch, info.world_size, info.rank, args.seed)
        batch = tuple(
            t.to(info.device) for t in next(stream)
        )  # x (batch, 1, 8, 8), y (batch,): this rank's
        report.results.update(world_size=info.world_size, batch_per_process=args.batch, knobs=[])
        trace_dir = Path(args.trace_dir or tmp)
        trace_dir.mkdir(parents=True, exist_ok=True)
        profile_section(raw, init_state, stream, trace_dir, args, info, report)
        if info.distributed:
            knobs_section(raw, init_state, batch, param_bytes, info, report)
        hooks_section(init_state, train_set, test_set, args, info, report)
        if info.distributed:
            resume_section(init_state, train_set, args, info, report)
        if args.compile_backend != "none":
            compile_section(raw, init_state, batch, args, info, report)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
