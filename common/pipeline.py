"""Pipeline parallelism by hand: stage splitting, micro-batches, GPipe and 1F1B schedules, timelines (lesson 07).

A model that is an `nn.Sequential` is cut at module indices into p stages; stage k lives on pp_rank k (names as
in picotron: pp_rank, pp_world_size, pp_is_first_stage, pp_is_last_stage). A batch of N samples is cut into m
micro-batches; activations flow forward with send/recv and gradients flow back the same way.

Schedules (GPipe: Huang et al. 2019, https://arxiv.org/abs/1811.06965; 1F1B: Narayanan et al. 2019, PipeDream,
https://arxiv.org/abs/1806.03377 and Megatron-LM, https://arxiv.org/abs/2104.04473):

    gpipe        F0 F1 .. F(m-1)  B0 B1 .. B(m-1)         every stage holds the activations of m micro-batches
    1f1b         (p-1-pp_rank) warm-up forwards, then alternate one forward and one backward, then the rest of
                 the backwards                            stage pp_rank holds at most p - pp_rank micro-batches

With equal stages both leave the same idle fraction, the bubble (p-1)/(m+p-1); 1F1B only lowers memory.

`TimedStage` wraps a stage so that it records when it computes (forward and backward), whichever schedule runs
it -- the hand-written one here or `torch.distributed.pipelining`'s (https://pytorch.org/docs/stable/distributed.pipelining.html).
`SimulatedKernel` is an optional, numerically neutral layer that keeps the stage busy for a fixed time per sample
(a sleep, standing in for a GPU kernel the host waits on): on a shared 2-core CPU it makes stage compute dominate
communication and scheduler noise, so the measured bubble can be compared with theory.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["split_model", "default_split_points", "microbatch_sizes", "gpipe_order", "one_f_one_b_order",
           "theory_bubble", "measured_bubble", "SimulatedKernel", "TimedStage", "activation_bytes",
           "StepResult", "run_pipeline_step", "plot_timeline"]


# ----------------------------------------------------------------------------------------------- splitting
def split_model(model: nn.Sequential, split_points: Sequence[int]) -> list[nn.Sequential]:
    """Cut `model` before each module index in `split_points`: [2, 4] on 6 modules -> [0:2], [2:4], [4:6].

    The stages share the model's parameters (no copy), so `sum(stage params) == model params`.

    Raises:
        ValueError: a split point outside 1 .. len(model)-1 (a stage would be empty), or points not increasing.
    """
    n = len(model)
    pts = list(split_points)
    for s in pts:
        if not 0 < s < n:
            raise ValueError(f"split point {s} is outside the model: a {n}-module model can be cut at 1..{n - 1}")
    if any(b <= a for a, b in zip(pts, pts[1:])):
        raise ValueError(f"split points must be strictly increasing, got {pts}")
    bounds = [0, *pts, n]
    return [model[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def default_split_points(model: nn.Sequential, num_stages: int) -> list[int]:
    """Cut points that give each of `num_stages` stages about the same number of Linear layers.

    A stage starts at a Linear (never between a Linear and its activation). Example: 5 Linears, 2 stages ->
    the 3rd Linear starts stage 1. Raises ValueError if there are fewer Linear layers than stages.
    """
    starts = [i for i, mod in enumerate(model) if isinstance(mod, nn.Linear)]
    if len(starts) < num_stages:
        raise ValueError(f"{len(starts)} Linear layers cannot fill {num_stages} stages")
    return [starts[round(k * len(starts) / num_stages)] for k in range(1, num_stages)]


def microbatch_sizes(batch_size: int, num_microbatches: int) -> list[int]:
    """Sizes of the m micro-batches of a batch, as `torch.chunk` cuts it: ceil(N/m) each, the rest last.

    10 into 4 -> [3, 3, 3, 1]; 8 into 4 -> [2, 2, 2, 2]. (`torch.distributed.pipelining` uses `tensor_split`
    instead, 10 into 4 -> [3, 3, 2, 2], and in torch 2.13 fails on unequal micro-batches; see lesson 07.)

    Raises:
        ValueError: m < 1, m > N (an empty micro-batch), or ceil(N/m)-sized chunks do not make m micro-batches
        (10 into 6 would give 5).
    """
    if num_microbatches < 1:
        raise ValueError(f"the number of micro-batches must be >= 1, got {num_microbatches}")
    if num_microbatches > batch_size:
        raise ValueError(f"{num_microbatches} micro-batches need at least {num_microbatches} samples, "
                         f"the batch has {batch_size}")
    c = math.ceil(batch_size / num_microbatches)
    sizes = [min(c, batch_size - i * c) for i in range(num_microbatches)]
    if min(sizes) < 1:
        raise ValueError(f"a batch of {batch_size} cut in chunks of {c} makes fewer than {num_microbatches} "
                         f"micro-batches; choose m dividing the batch more evenly")
    return sizes


# ----------------------------------------------------------------------------------------------- schedules
def gpipe_order(num_microbatches: int) -> list[tuple[str, int]]:
    """GPipe on any stage: all forwards, then all backwards: [('F',0),..,('F',m-1),('B',0),..,('B',m-1)]."""
    m = num_microbatches
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_order(num_microbatches: int, pp_world_size: int, pp_rank: int) -> list[tuple[str, int]]:
    """1F1B on stage `pp_rank` of `pp_world_size`: warm-up forwards, one-forward-one-backward, cool-down.

    The warm-up is min(p-1-pp_rank, m) forwards, so the last stage starts backward after its first forward and
    stage k never holds more than p-k micro-batches' activations (GPipe holds m).
    """
    m, p = num_microbatches, pp_world_size
    warmup = min(p - 1 - pp_rank, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]
    return order


def theory_bubble(pp_world_size: int, num_microbatches: int) -> float:
    """(p-1)/(m+p-1): the idle fraction of p equal stages running m micro-batches (GPipe or 1F1B)."""
    p, m = pp_world_size, num_microbatches
    return (p - 1) / (m + p - 1)


def measured_bubble(events_per_stage: Sequence[Sequence[tuple]]) -> dict:
    """Idle fraction of a recorded step: 1 - (sum of busy time over stages) / (p x span).

    Args:
        events_per_stage: events_per_stage[k] = [(kind, microbatch, start_s, end_s), ...] of stage k, times on a
            common clock (each rank's time since a shared barrier).

    Returns:
        {"bubble": idle fraction, "span_s": first start to last end over all stages, "busy_s": per stage}.
        Communication waits count as idle: this is what the bubble costs.
    """
    starts = [e[2] for evs in events_per_stage for e in evs]
    ends = [e[3] for evs in events_per_stage for e in evs]
    span = max(ends) - min(starts)
    busy = [sum(e[3] - e[2] for e in evs) for evs in events_per_stage]
    return {"bubble": 1 - sum(busy) / (len(events_per_stage) * span), "span_s": span, "busy_s": busy}


# ----------------------------------------------------------------------------------------------- instruments
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
    """Wrap a stage so that every forward and backward it runs is recorded as (kind, microbatch, start, end).

    The i-th forward is micro-batch i, and so is the i-th backward: GPipe and 1F1B (hand-written or
    torch.distributed.pipelining's) both process micro-batches in order in each direction. Times are seconds of
    `time.perf_counter()` minus `self.t0`; call `reset()` right after a barrier so all ranks share a time zero.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self._dummy = torch.zeros((), requires_grad=True)
        self.reset()

    def reset(self) -> None:
        self.events: list[tuple[str, int, float, float]] = []
        self._count = {"F": 0, "B": 0}
        self._start: dict[str, float] = {}
        self.t0 = time.perf_counter()

    def _open(self, kind: str) -> None:
        self._start[kind] = time.perf_counter() - self.t0

    def _close(self, kind: str) -> None:
        end = time.perf_counter() - self.t0
        self.events.append((kind, self._count[kind], self._start.pop(kind), end))
        self._count[kind] += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # e.g. PipelineStage's shape inference: not part of the training step
            return self.module(x)
        if self._dummy.device != x.device:
            self._dummy = torch.zeros((), requires_grad=True, device=x.device)
        return _End.apply(self.module(_Begin.apply(x, self._dummy, self)), self)


@contextmanager
def activation_bytes(params: Sequence[torch.Tensor] = ()) -> Iterator[list]:
    """Count bytes of the tensors autograd saves for backward in this block, leaving out `params`.

    Unlike `common.counters.saved_tensor_bytes` (which counts whole storages, right for one model call), this
    counts each saved tensor's own bytes (numel x element size), once per (address, shape), and skips the weights
    a Linear saves: a micro-batch that is a view into the batch counts its own rows, not the whole batch. What
    remains is the activations a stage keeps per micro-batch until its backward. Yields [bytes].
    (https://pytorch.org/docs/stable/autograd.html#saved-tensors-hooks)
    """
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: set = set()
    out = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if t.untyped_storage().data_ptr() not in skip and key not in seen:
            seen.add(key)
            out[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield out


# ----------------------------------------------------------------------------------------------- the executor
@dataclass
class StepResult:
    """What one stage saw during one pipelined training step (before the optimizer step).

    Attributes:
        loss: on the last stage, the batch's mean loss sum_i (n_i / N) loss_i; None elsewhere.
        events: this stage's (kind, microbatch, start_s, end_s), if the stage is a TimedStage.
        peak_live_microbatches: most micro-batches whose forward ran and whose backward had not.
        peak_activation_bytes: most bytes of saved activations held at once (see `activation_bytes`).
    """

    loss: float | None
    events: list = field(default_factory=list)
    peak_live_microbatches: int = 0
    peak_activation_bytes: int = 0


def run_pipeline_step(stage: nn.Module, order: Sequence[tuple[str, int]], *, pp_rank: int, pp_world_size: int,
                      sizes: Sequence[int], recv_shape: tuple[int, ...], inputs: Sequence[torch.Tensor] = (),
                      targets: Sequence[torch.Tensor] = (), loss_fn: Callable | None = None,
                      device: torch.device = torch.device("cpu"), dtype: torch.dtype = torch.float32,
                      rank_of: Callable[[int], int] = lambda k: k) -> StepResult:
    """Run forward and backward of one batch through this rank's stage in the given order; leaves .grad set.

    Activations go to pp_rank+1 and gradients to pp_rank-1 with `dist.isend` (non-blocking: with blocking sends
    1F1B deadlocks, both neighbours sending at once) and arrive with blocking receives; the per-pair order of
    messages is the same on both ends, so they match.

    A send that is directly followed by a receive from the same peer is posted together with it in one
    `dist.batch_isend_irecv` (as torch.distributed.pipelining's Schedule1F1B does). Why: NCCL runs a rank's
    operations with one peer in the order they were posted, and a send larger than its internal buffer
    (NCCL_BUFFSIZE, 4 MiB by default) waits for the matching receive. In 1F1B with 2 stages, stage 0 would post
    "send activation i+1" then "receive gradient i" while stage 1 posts "send gradient i" then "receive
    activation i+1": posted one by one, large messages would wait for each other until the timeout.

    Args:
        stage: this rank's modules; (n_i, *recv_shape) -> next stage's input, or logits on the last stage.
        order: [('F', i) / ('B', i), ...], from `gpipe_order` or `one_f_one_b_order`.
        sizes: samples per micro-batch, sum = N (unequal sizes are fine: 3, 3, 3, 1).
        recv_shape: per-sample shape of this stage's input (not used on the first stage).
        inputs / targets: the micro-batches, on the first / last stage.
        loss_fn: mean loss of one micro-batch (logits, target) -> scalar; weighted by n_i/N here so that the
            sum over micro-batches is the mean over the whole batch.
        rank_of: global rank of stage k (k itself when the pipeline is the whole world).

    Raises:
        ValueError: order does not contain each micro-batch's F before its B exactly once.
    """
    m = len(sizes)
    if sorted(order) != sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)]):
        raise ValueError(f"order must hold F and B of micro-batches 0..{m - 1} once each, got {order}")
    first, last = pp_rank == 0, pp_rank == pp_world_size - 1
    total = sum(sizes)
    params = list(stage.parameters())
    kept: dict[int, tuple] = {}  # micro-batch -> (input, output or weighted loss, activation bytes)
    sends: list = []
    held: list = []  # a send waiting to be posted with the receive that comes right after it

    def recv_peer(step: int) -> int | None:
        """The rank the op at order[step] starts by receiving from (None: it receives nothing)."""
        if step >= len(order):
            return None
        if order[step][0] == "F":
            return None if first else rank_of(pp_rank - 1)
        return None if last else rank_of(pp_rank + 1)

    def send(t: torch.Tensor, dst: int, step: int) -> None:
        if recv_peer(step + 1) == dst:
            held.append(dist.P2POp(dist.isend, t, dst))  # posted together with that receive
        else:
            sends.append(dist.isend(t, dst=dst))

    def recv(buf: torch.Tensor, src: int) -> None:
        works = dist.batch_isend_irecv([*held, dist.P2POp(dist.irecv, buf, src)])
        sends.extend(works[:-1])
        held.clear()
        works[-1].wait()

    live = peak_live = live_bytes = peak_bytes = 0
    loss_sum = 0.0
    for step, (kind, i) in enumerate(order):
        if kind == "F":
            if first:
                x = inputs[i].to(device)
            else:
                x = torch.empty((sizes[i], *recv_shape), device=device, dtype=dtype)
                recv(x, rank_of(pp_rank - 1))
                x.requires_grad_()  # we need d loss / d x to send back to the previous stage
            with activation_bytes(params) as saved:
                out = stage(x)
                if last:
                    out = loss_fn(out, targets[i].to(device)) * (sizes[i] / total)  # weight n_i / N
            nbytes = saved[0]
            if not last:
                send(out.detach(), rank_of(pp_rank + 1), step)
            else:
                loss_sum += out.item()
            kept[i] = (x, out, nbytes)
            live += 1
            live_bytes += nbytes
            peak_live, peak_bytes = max(peak_live, live), max(peak_bytes, live_bytes)
        else:
            x, out, nbytes = kept.pop(i)
            if last:
                out.backward()
            else:
                g = torch.empty_like(out)
                recv(g, rank_of(pp_rank + 1))
                out.backward(g)
            if not first:
                send(x.grad, rank_of(pp_rank - 1), step)
            live -= 1
            live_bytes -= nbytes
    for s in sends:
        s.wait()
    return StepResult(loss_sum if last else None, list(getattr(stage, "events", [])), peak_live, peak_bytes)


# ----------------------------------------------------------------------------------------------- plotting
def plot_timeline(events_per_stage: Sequence[Sequence[tuple]], title: str = "", ax=None, unit: float = 1e3):
    """Gantt chart of a recorded step: one row per stage, forward boxes light, backward boxes dark, labelled
    with the micro-batch. Times in ms (unit=1e3). Returns the Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.5 * len(events_per_stage) + 1))
    t0 = min(e[2] for evs in events_per_stage for e in evs)
    cmap = plt.get_cmap("tab10")
    for k, evs in enumerate(events_per_stage):
        for kind, i, s, e in evs:
            color = cmap(i % 10)
            ax.barh(k, (e - s) * unit, left=(s - t0) * unit, height=0.8, color=color,
                    alpha=0.45 if kind == "F" else 0.95, edgecolor="black", linewidth=0.5)
            ax.text((s - t0 + (e - s) / 2) * unit, k, f"{kind}{i}", ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(events_per_stage)), [f"stage {k}" for k in range(len(events_per_stage))])
    ax.invert_yaxis()
    ax.set_xlabel("time since the step began (ms)")
    ax.set_title(title)
    return ax
