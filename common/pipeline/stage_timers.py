"""Instruments for pipeline stages: when each stage computes and the bubble that leaves (lesson 09; the
timeline plot is `common.plots.pipeline.plot_timeline`, the bytes a stage holds `common.pipeline.executor`).

`TimedStage` wraps a stage so that it records when it computes (forward and backward), whichever schedule runs
it: the hand-written executor (`common.pipeline.executor`) or `torch.distributed.pipelining`'s
(https://pytorch.org/docs/stable/distributed.pipelining.html). `SimulatedKernel` is an optional, numerically
neutral layer that keeps the stage busy for a fixed time per sample (a sleep, standing in for a GPU kernel the
host waits on): on a shared 2-core CPU it makes stage compute dominate communication and scheduler noise, so the
measured bubble can be compared with theory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.nn as nn

__all__ = [
    "SimulatedKernel",
    "TimedStage",
    "timed_stages",
    "record_step",
    "measured_bubble",
    "busy_overlap_s",
    "peak_live",
]


class _SleepFn(torch.autograd.Function):
    """Identity whose forward and backward each keep the host busy for a given time (a stand-in kernel)."""

    @staticmethod
    def forward(ctx, x, fwd_s: float, bwd_s: float):
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.bwd_s)
        return g, None, None


class SimulatedKernel(nn.Module):
    """Identity layer that takes `ms_per_sample` x rows milliseconds forward and twice that backward.

    Numerically neutral (no parameters, returns its input), so a pipeline with it computes exactly what the model
    without it computes. Backward = 2 x forward, as for a Linear (grad of input and grad of weight).
    Shapes: (B, ...) -> (B, ...).
    """

    def __init__(self, ms_per_sample: float):
        super().__init__()
        self.ms_per_sample = float(ms_per_sample)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ms_per_sample <= 0:
            return x
        t = self.ms_per_sample * x.shape[0] / 1000
        return _SleepFn.apply(x, t, 2 * t)


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:  # CUDA runs asynchronously: wait for the stage's kernels before reading the clock
        torch.cuda.synchronize(t.device)


class _Begin(torch.autograd.Function):
    """Marks the stage's input: forward records the forward start; backward records the backward end.

    `dummy` (a leaf that requires grad) makes autograd call our backward even on the first stage, whose input
    does not require grad."""

    @staticmethod
    def forward(ctx, x, dummy, stage):
        ctx.stage = None if x.is_meta else stage  # meta tensors: shape inference, not compute
        _sync(x)
        if ctx.stage is not None:
            stage._open("F")
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _sync(g)
        if ctx.stage is not None:
            ctx.stage._close("B")
        return (g if ctx.needs_input_grad[0] else None), torch.zeros((), device=g.device), None


class _End(torch.autograd.Function):
    """Marks the stage's output: forward records the forward end; backward records the backward start."""

    @staticmethod
    def forward(ctx, y, stage):
        ctx.stage = None if y.is_meta else stage
        _sync(y)
        if ctx.stage is not None:
            stage._close("F")
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        _sync(g)
        if ctx.stage is not None:
            ctx.stage._open("B")
        return g, None


class TimedStage(nn.Module):
    """Wrap a stage so that every forward and backward it runs is recorded as (kind, microbatch, start, end, stage).

    The i-th forward is micro-batch i, and so is the i-th backward: GPipe, 1F1B and interleaved 1F1B
    (hand-written or torch.distributed.pipelining's) all process a stage's micro-batches in order in each
    direction. Times are seconds of `time.perf_counter()` minus `self.t0`; call `reset()` right after a barrier
    so all ranks share a time zero. `stage_index` labels the events (a rank may hold several stages).
    """

    def __init__(self, module: nn.Module, stage_index: int = 0):
        super().__init__()
        self.module = module
        self.stage_index = stage_index
        self._dummy = torch.zeros((), requires_grad=True)
        self.reset()

    def reset(self) -> None:
        self.events: list[tuple[str, int, float, float, int]] = []
        self._count = {"F": 0, "B": 0}
        self._start: dict[str, float] = {}
        self.t0 = time.perf_counter()

    def _open(self, kind: str) -> None:
        self._start[kind] = time.perf_counter() - self.t0

    def _close(self, kind: str) -> None:
        end = time.perf_counter() - self.t0
        self.events.append((kind, self._count[kind], self._start.pop(kind), end, self.stage_index))
        self._count[kind] += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            not torch.is_grad_enabled()
        ):  # e.g. PipelineStage's shape inference: not part of the training step
            return self.module(x)
        if self._dummy.device != x.device:
            self._dummy = torch.zeros((), requires_grad=True, device=x.device)
        return _End.apply(self.module(_Begin.apply(x, self._dummy, self)), self)


def timed_stages(
    parts: Sequence[nn.Sequential], indices: Sequence[int], device
) -> list[TimedStage]:
    """This rank's stages `parts[i]` for i in `indices`, each timed and ending in a SimulatedKernel that stays
    off until `record_step` sets its time per sample."""
    return [
        TimedStage(nn.Sequential(*parts[i], SimulatedKernel(0.0)), i).to(device) for i in indices
    ]


T = TypeVar("T")


def record_step(
    step: Callable[[], T],
    stages: Sequence[TimedStage],
    barrier: Callable[[], None],
    ms_per_sample: float = 0.0,
    warmup: bool = True,
) -> tuple[T, list]:
    """Record one training step of this rank's stages from a time zero shared by all ranks.

    With `warmup`, `step` first runs with every SimulatedKernel off, then the gradients are cleared: in torch 2.13
    a PipelineStage's first step also infers shapes, and the first message on each pair of ranks sets up its
    connection; neither belongs to the recorded step. Then each stage's SimulatedKernel (its last module) gets
    `ms_per_sample`, every rank meets at `barrier`, resets its clocks and runs `step` again. Returns (what that
    step returned, this rank's events of every stage sorted by start time).
    """
    kernels = [s.module[-1] for s in stages if isinstance(s.module[-1], SimulatedKernel)]
    if warmup:
        for k in kernels:
            k.ms_per_sample = 0.0
        step()
        for s in stages:
            s.zero_grad(set_to_none=True)
    for k in kernels:
        k.ms_per_sample = ms_per_sample
    barrier()
    for s in stages:
        s.reset()  # time zero just after the barrier, on every rank
    out = step()
    return out, sorted((e for s in stages for e in s.events), key=lambda e: e[2])


def measured_bubble(events_per_rank: Sequence[Sequence[tuple]]) -> dict:
    """Idle fraction of a recorded step: 1 - (sum of busy time over ranks) / (p x span).

    Args:
        events_per_rank: events_per_rank[k] = [(kind, microbatch, start_s, end_s, ...), ...] of every stage rank
            k holds, times on a common clock (each rank's time since a shared barrier).

    Returns:
        {"bubble": idle fraction, "span_s": first start to last end over all ranks, "busy_s": per rank}.
        Communication waits count as idle: this is what the bubble costs.
    """
    starts = [e[2] for evs in events_per_rank for e in evs]
    ends = [e[3] for evs in events_per_rank for e in evs]
    span = max(ends) - min(starts)
    busy = [sum(e[3] - e[2] for e in evs) for evs in events_per_rank]
    return {"bubble": 1 - sum(busy) / (len(events_per_rank) * span), "span_s": span, "busy_s": busy}


def busy_overlap_s(events_per_device: Sequence[Sequence[tuple]]) -> float:
    """Seconds during which two recorded busy intervals overlap (0.0: one device busy at a time)."""
    ivs = sorted((e[2], e[3]) for evs in events_per_device for e in evs)
    return sum(max(0.0, min(a[1], b[1]) - b[0]) for a, b in zip(ivs, ivs[1:]))


def peak_live(events: Sequence[tuple]) -> int:
    """Most micro-batches a rank held at once: +1 when a forward ends, -1 when its backward ends."""
    live = peak = 0
    for e in sorted(events, key=lambda e: e[3]):
        live += 1 if e[0] == "F" else -1
        peak = max(peak, live)
    return peak
