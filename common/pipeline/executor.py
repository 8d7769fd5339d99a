"""A hand-written pipeline executor: one stage per rank, activations forward and gradients back with send/recv,
in the order a schedule gives (lesson 09).

It runs the orders of `common.pipeline.schedules` (GPipe, 1F1B) on this rank's stage; torch's own executor is
`torch.distributed.pipelining` (`PipelineStage` + `ScheduleGPipe` / `Schedule1F1B`,
https://pytorch.org/docs/stable/distributed.pipelining.html), which lesson 09 runs beside it. Unlike torch 2.13's,
this one takes unequal micro-batches (3, 3, 3, 1) and weights each micro-batch's mean loss by n_i/N.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from common.measure.memory import saved_bytes

CPU = torch.device("cpu")

__all__ = ["StepResult", "check_order", "run_pipeline_step", "executor_step"]


@dataclass
class StepResult:
    """What one stage saw during one pipelined training step (before the optimizer step).

    Attributes:
        loss: on the last stage, the batch's mean loss sum_i (n_i / N) loss_i; None elsewhere.
        events: this stage's (kind, microbatch, start_s, end_s, stage), if the stage is a `TimedStage`.
        peak_live_microbatches: most micro-batches whose forward ran and whose backward had not.
        peak_activation_bytes: most bytes of saved activations held at once: each micro-batch's saved tensors,
            counted by `common.measure.memory.saved_bytes(views=True)` (a micro-batch is a view into the batch,
            and a stage holds its rows), weights excluded, from its forward until its backward.
    """

    loss: float | None
    events: list = field(default_factory=list)
    peak_live_microbatches: int = 0
    peak_activation_bytes: int = 0


def check_order(order: Sequence[tuple[str, int]], num_microbatches: int) -> None:
    """Raise ValueError unless `order` holds ('F', i) and ('B', i) once each for i < m, every F before its B."""
    m = num_microbatches
    if sorted(order) != sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)]):
        raise ValueError(
            f"order must hold F and B of micro-batches 0..{m - 1} once each, got {order}"
        )
    forwarded: set[int] = set()
    for kind, i in order:
        if kind == "B" and i not in forwarded:
            raise ValueError(f"the backward of micro-batch {i} comes before its forward in {order}")
        forwarded.add(i)


@dataclass
class _StageStep:
    """One pipelined training step of one stage (its arguments: `run_pipeline_step`'s): the micro-batches it
    holds for backward, its messages to its neighbours, the loss and the peaks of what it held.

    A send that is directly followed by a receive from the same peer is posted together with it in one
    `dist.batch_isend_irecv` (as torch.distributed.pipelining's Schedule1F1B does). Why: NCCL runs a rank's
    operations with one peer in the order they were posted, and a send larger than its internal buffer
    (NCCL_BUFFSIZE, 4 MiB by default) waits for the matching receive. In 1F1B with 2 stages, stage 0 would post
    "send activation i+1" then "receive gradient i" while stage 1 posts "send gradient i" then "receive
    activation i+1": posted one by one, large messages would wait for each other until the timeout.
    """

    stage: nn.Module
    order: Sequence[tuple[str, int]]
    pp_rank: int
    pp_world_size: int
    ranks: list[int]
    sizes: Sequence[int]
    recv_shape: tuple[int, ...]
    inputs: Sequence[torch.Tensor]
    targets: Sequence[torch.Tensor]
    loss_fn: Callable | None
    device: torch.device
    dtype: torch.dtype
    kept: dict = field(
        default_factory=dict
    )  # micro-batch -> (input, output or weighted loss, bytes)
    sends: list = field(default_factory=list)
    held: list = field(
        default_factory=list
    )  # a send waiting to be posted with the receive after it
    live: int = 0
    peak_live: int = 0
    live_bytes: int = 0
    peak_bytes: int = 0
    loss_sum: float = 0.0

    def __post_init__(self) -> None:
        self.first, self.last = self.pp_rank == 0, self.pp_rank == self.pp_world_size - 1
        self.total = sum(self.sizes)
        self.params = list(self.stage.parameters())

    def recv_peer(self, step: int) -> int | None:
        """The rank the op at order[step] starts by receiving from (None: it receives nothing)."""
        if step >= len(self.order):
            return None
        if self.order[step][0] == "F":
            return None if self.first else self.ranks[self.pp_rank - 1]
        return None if self.last else self.ranks[self.pp_rank + 1]

    def send(self, t: torch.Tensor, dst: int, step: int) -> None:
        if self.recv_peer(step + 1) == dst:
            self.held.append(dist.P2POp(dist.isend, t, dst))  # posted together with that receive
        else:
            self.sends.append(dist.isend(t, dst=dst))

    def recv(self, buf: torch.Tensor, src: int) -> None:
        works = dist.batch_isend_irecv([*self.held, dist.P2POp(dist.irecv, buf, src)])
        self.sends.extend(works[:-1])
        self.held.clear()
        works[-1].wait()

    def forward(self, step: int, i: int) -> None:
        if self.first:
            x = self.inputs[i].to(self.device)
        else:
            x = torch.empty((self.sizes[i], *self.recv_shape), device=self.device, dtype=self.dtype)
            self.recv(x, self.ranks[self.pp_rank - 1])
            x.requires_grad_()  # we need d loss / d x to send back to the previous stage
        with saved_bytes(self.params, views=True) as saved:
            out = self.stage(x)
            if self.last:
                target = self.targets[i].to(self.device)
                out = self.loss_fn(out, target) * (self.sizes[i] / self.total)  # weight n_i / N
        if not self.last:
            self.send(out.detach(), self.ranks[self.pp_rank + 1], step)
        else:
            self.loss_sum += out.item()
        self.kept[i] = (x, out, saved.bytes)
        self.live += 1
        self.live_bytes += saved.bytes
        self.peak_live = max(self.peak_live, self.live)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def backward(self, step: int, i: int) -> None:
        x, out, nbytes = self.kept.pop(i)
        if self.last:
            out.backward()
        else:
            g = torch.empty_like(out)
            self.recv(g, self.ranks[self.pp_rank + 1])
            out.backward(g)
        if not self.first:
            self.send(x.grad, self.ranks[self.pp_rank - 1], step)
        self.live -= 1
        self.live_bytes -= nbytes


def run_pipeline_step(
    stage: nn.Module,
    order: Sequence[tuple[str, int]],
    *,
    pp_rank: int,
    pp_world_size: int,
    sizes: Sequence[int],
    recv_shape: tuple[int, ...],
    inputs: Sequence[torch.Tensor] = (),
    targets: Sequence[torch.Tensor] = (),
    loss_fn: Callable | None = None,
    device: torch.device = CPU,
    dtype: torch.dtype = torch.float32,
    stage_ranks: Sequence[int] | None = None,
) -> StepResult:
    """Run forward and backward of one batch through this rank's stage in the given order; leaves .grad set.

    Activations go forward, gradients back, by `dist.isend` (non-blocking: with blocking sends 1F1B deadlocks,
    both neighbours sending at once) and blocking receives, in the same order per pair on both ends (a send
    followed by a receive from its peer is posted with it: see `_StageStep`).

    Args:
        stage: this rank's modules; (n_i, *recv_shape) -> next stage's input, or logits on the last stage.
        order: [('F', i) / ('B', i), ...], from `gpipe_order` or `one_f_one_b_order`.
        sizes: samples per micro-batch, sum = N (unequal sizes are fine: 3, 3, 3, 1).
        recv_shape: per-sample shape of this stage's input (not used on the first stage).
        inputs / targets: the micro-batches, on the first / last stage.
        loss_fn: mean loss of one micro-batch (logits, target) -> scalar; weighted by n_i/N here so that the
            sum over micro-batches is the mean over the whole batch.
        stage_ranks: global rank of each stage (`Grid.ranks_in("pp")`); default: stage k on rank k.

    Raises:
        ValueError: order lacks a micro-batch's F or B, or has one twice or B first (checked before any send).
    """
    check_order(order, len(sizes))
    ranks = list(range(pp_world_size)) if stage_ranks is None else list(stage_ranks)
    state = _StageStep(
        stage,
        order,
        pp_rank,
        pp_world_size,
        ranks,
        sizes,
        recv_shape,
        inputs,
        targets,
        loss_fn,
        device,
        dtype,
    )
    for step, (kind, i) in enumerate(order):
        if kind == "F":
            state.forward(step, i)
        else:
            state.backward(step, i)
    for work in state.sends:
        work.wait()
    events = list(getattr(stage, "events", []))
    loss = state.loss_sum if state.last else None
    return StepResult(loss, events, state.peak_live, state.peak_bytes)


def executor_step(
    stage: nn.Module,
    order: Sequence[tuple[str, int]],
    pp_rank: int,
    stage_ranks: Sequence[int],
    sizes: Sequence[int],
    x: torch.Tensor,
    y: torch.Tensor,
    device: torch.device = CPU,
) -> Callable[[], tuple[float | None, int]]:
    """A function that runs `run_pipeline_step` on this rank's stage for the batch (x, y) cut into `sizes`, with
    the mean cross-entropy loss, and returns (the batch's loss on the last stage, else None; this stage's peak
    activation bytes). The stage's input width is its first Linear's `in_features`."""
    p = len(stage_ranks)
    in_features = next(m.in_features for m in stage.modules() if isinstance(m, nn.Linear))

    def step() -> tuple[float | None, int]:
        res = run_pipeline_step(
            stage,
            order,
            pp_rank=pp_rank,
            pp_world_size=p,
            sizes=sizes,
            recv_shape=(in_features,),
            stage_ranks=stage_ranks,
            inputs=list(x.split(sizes)) if pp_rank == 0 else [],
            targets=list(y.split(sizes)) if pp_rank == p - 1 else [],
            loss_fn=F.cross_entropy,
            device=device,
        )
        return res.loss, res.peak_activation_bytes

    return step
