"""Where a DDP step's time goes, read from a `torch.profiler` chrome trace (lesson 17, benchmarks/ddp_knobs.py).

The lesson profiles a few steps with each phase inside `record_function("forward" | "backward" | "optimizer")`
and exports the trace (`prof.export_chrome_trace(path)`, open it in https://ui.perfetto.dev or chrome://tracing).
This module turns one rank's trace into intervals, in ms from the step's start:

- backward compute: on CPU the autograd engine's `autograd::engine::evaluate_function: ...` events (each is
  one backward node, run on the thread that called backward), a node that issues a bucket (`c10d::allreduce_`
  inside it) counted until it issues; on CUDA the GPU kernels of that step that are not communication. The
  backward *window* spans the first to the last of them.
- all-reduce: one event per bucket, run by the backend, not by the thread that computes: gloo's
  `gloo:all_reduce` on its worker threads, NCCL's `ncclDevKernel_AllReduce...` kernels on a GPU stream.
- hidden fraction: the part of the all-reduce time (union of the step's all-reduce intervals) that lies inside
  the backward window, over all of it. All-reduce time outside the window is *exposed*: the step waits for it
  (DDP's reducer waits for every bucket at the end of backward, before the optimizer may run).

Times are as the profiler saw them on a loaded machine: report them as `[perf]`, never assert on them. The
number of all-reduces per step, however, is a count: one per bucket, whatever the timing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = [
    "PHASES",
    "StepProfile",
    "load_trace",
    "union_length",
    "intersect_length",
    "step_profiles",
    "summarize",
    "is_allreduce",
]

# the record_function labels the lesson puts around each phase
PHASES = ("forward", "backward", "optimizer")
_ALLREDUCE = re.compile(r"^(gloo|nccl|c10d):all_?reduce$|nccl\w*kernel_?allreduce", re.IGNORECASE)
_ENQUEUE = "c10d::allreduce_"  # the caller enqueuing an all-reduce: not the communication itself


def is_allreduce(name: str) -> bool:
    """True for the events that ARE an all-reduce running (gloo's worker event, an NCCL kernel)."""
    return name != _ENQUEUE and bool(_ALLREDUCE.search(name))


@dataclass
class StepProfile:
    """One training step on one rank; every time in ms from the step's start (the forward's start).

    Attributes:
        phases: {"forward": (start, end), "backward": ..., "optimizer": ...} of the record_function ranges.
        backward_window: (first backward compute start, last backward compute end).
        backward_ops: number of backward compute events (autograd nodes on CPU, kernels on CUDA).
        ops_after_first_issue: autograd nodes that started after the first bucket's all-reduce was issued
            (`c10d::allreduce_` on the calling thread): backward work left to hide communication behind. A count,
            set by the order of the graph and the buckets, not by timing.
        allreduce: [(start, end)] per bucket, in order of start.
        allreduce_ms: length of the union of the all-reduce intervals.
        hidden_ms: the part of it inside the backward window.
    """

    phases: dict = field(default_factory=dict)
    backward_window: tuple = (0.0, 0.0)
    backward_ops: int = 0
    ops_after_first_issue: int = 0
    allreduce: list = field(default_factory=list)
    allreduce_ms: float = 0.0
    hidden_ms: float = 0.0

    @property
    def hidden_fraction(self) -> float:
        """hidden_ms / allreduce_ms (0.0 when there is no all-reduce: one process)."""
        return self.hidden_ms / self.allreduce_ms if self.allreduce_ms > 0 else 0.0

    @property
    def exposed_ms(self) -> float:
        return self.allreduce_ms - self.hidden_ms

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "hidden_fraction": self.hidden_fraction,
            "exposed_ms": self.exposed_ms,
        }


def load_trace(path: str | Path) -> list[dict]:
    """The complete events ("ph": "X", with "ts" and "dur" in microseconds) of a chrome trace file."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def union_length(intervals: Iterable[Sequence[float]]) -> float:
    """Total length covered by possibly overlapping (start, end) intervals (each point counted once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted((float(a), float(b)) for a, b in intervals if b > a):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def intersect_length(intervals: Iterable[Sequence[float]], window: Sequence[float]) -> float:
    """Length of the union of `intervals` that lies inside `window` = (start, end)."""
    lo, hi = window
    return union_length((max(s, lo), min(e, hi)) for s, e in intervals)


def _span(e: dict) -> tuple[float, float]:
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def step_profiles(events: list[dict]) -> list[StepProfile]:
    """Cut one rank's trace into steps (one per `forward` range) and measure each; see the module docstring.

    Raises:
        ValueError: the trace has no `forward` / `backward` ranges (profile with the PHASES labels).
    """
    marks = {
        p: sorted(_span(e) for e in events if e["name"] == p and e.get("cat") == "user_annotation")
        for p in PHASES
    }
    if not marks["forward"] or len(marks["backward"]) != len(marks["forward"]):
        raise ValueError(
            f"trace needs one record_function range per phase {PHASES} per step; found "
            f"{ {p: len(v) for p, v in marks.items()} }"
        )
    kernels = [e for e in events if e.get("cat") == "kernel"]  # GPU kernels (CUDA traces only)
    issued = sorted(_span(e)[0] for e in events if e["name"] == _ENQUEUE)
    nodes = [
        _span(e) for e in events if e["name"].startswith("autograd::engine::evaluate_function")
    ]
    if kernels:
        compute = [_span(e) for e in kernels if not is_allreduce(e["name"])]
    else:  # a node that issues a bucket (DDP's hook runs inside the gradient's AccumulateGrad node) computes
        # only until it issues: what follows is the reducer enqueuing communication, not backward compute
        compute = [(s, min([e] + [t for t in issued if s < t < e])) for s, e in nodes]
    # on CUDA the kernels are the communication; the CPU-side "nccl:all_reduce" range only enqueues them
    comm = sorted(_span(e) for e in (kernels or events) if is_allreduce(e["name"]))
    nodes = [s for s, _ in nodes]
    steps = []
    for i, (f0, _) in enumerate(marks["forward"]):
        b0 = marks["backward"][i][0]
        end = marks["forward"][i + 1][0] if i + 1 < len(marks["forward"]) else float("inf")
        opt = [m for m in marks["optimizer"] if f0 <= m[0] < end]
        # backward compute of this step: starts after the backward range opened and before the next forward
        # (on CUDA a kernel can run after the CPU left the range; the optimizer's kernels start after its mark)
        stop = opt[0][0] if opt else end
        ops = [c for c in compute if b0 <= c[0] < stop]
        ars = [c for c in comm if b0 <= c[0] < end]
        first = next((t for t in issued if b0 <= t < stop), None)
        after = 0 if first is None else sum(first < t < stop for t in nodes)
        window = (min(s for s, _ in ops), max(e for _, e in ops)) if ops else (b0, b0)
        ms = lambda t: (t - f0) / 1000.0  # noqa: E731  us from the trace -> ms from the step's start
        phases = {"forward": marks["forward"][i], "backward": marks["backward"][i]}
        if opt:
            phases["optimizer"] = opt[0]
        steps.append(
            StepProfile(
                phases={p: (ms(s), ms(e)) for p, (s, e) in phases.items()},
                backward_window=(ms(window[0]), ms(window[1])),
                backward_ops=len(ops),
                ops_after_first_issue=after,
                allreduce=[(ms(s), ms(e)) for s, e in ars],
                allreduce_ms=union_length(ars) / 1000.0,
                hidden_ms=intersect_length(ars, window) / 1000.0,
            )
        )
    return steps


def summarize(steps: list[StepProfile]) -> dict:
    """Over the profiled steps: all-reduces per step (a list: one count per step), the mean step, all-reduce,
    hidden and exposed ms, and the hidden fraction of the summed all-reduce time."""
    n = max(len(steps), 1)
    total = sum(s.allreduce_ms for s in steps)
    hidden = sum(s.hidden_ms for s in steps)
    return {
        "allreduces_per_step": [len(s.allreduce) for s in steps],
        "ops_after_first_issue": [s.ops_after_first_issue for s in steps],
        "step_ms": sum(max(e for _, e in s.phases.values()) for s in steps) / n,
        "backward_ms": sum(s.phases["backward"][1] - s.phases["backward"][0] for s in steps) / n,
        "allreduce_ms": total / n,
        "hidden_ms": hidden / n,
        "exposed_ms": (total - hidden) / n,
        "hidden_fraction": hidden / total if total > 0 else 0.0,
    }
