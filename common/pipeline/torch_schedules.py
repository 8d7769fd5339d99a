"""`torch.distributed.pipelining` on lesson 09's stages: its `PipelineStage` and schedule classes
(ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B), and what its `step()` does to .grad across calls.
(https://pytorch.org/docs/stable/distributed.pipelining.html)

torch 2.13 (pipelining/schedules.py, stage.py): `step()` never clears parameter gradients
(`clear_runtime_states` resets only received inputs' .grad), so they accumulate across calls, but with
scale_grads=True (the default) each step ends by dividing ALL of .grad by m, the previous call's share included:
two calls on one batch leave g/m + g, not 2g. Zero the gradients before each step() and raise m instead; or pass
scale_grads=False and divide the loss yourself (`accumulation_across_steps` measures all three).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from common.models import mlp
from common.pipeline.schedules import split_model

__all__ = ["torch_schedule_step", "accumulation_across_steps"]


def torch_schedule_step(
    schedule: str,
    modules: Sequence[nn.Module],
    stage_indices: Sequence[int],
    num_stages: int,
    num_microbatches: int,
    group,
    x: torch.Tensor,
    y: torch.Tensor,
    device: torch.device,
) -> Callable[[], tuple[float | None, None]]:
    """A function that runs one training step of torch's "torch-gpipe", "torch-1f1b" or
    "torch-interleaved-1f1b" on this rank's stages (`modules`, stage `stage_indices[k]` of `num_stages`)
    and returns (the batch's mean loss on the last stage, else None; None: no bytes counted).

    Each micro-batch's loss is its mean; the schedule divides the summed gradients by m (scale_grads=True), which
    is the full-batch mean only when the micro-batches are equal: hence m must divide N here.
    """
    stages = [
        PipelineStage(mod, i, num_stages, device, group=group)
        for mod, i in zip(modules, stage_indices)
    ]
    first, last = stage_indices[0] == 0, stage_indices[-1] == num_stages - 1
    if schedule == "torch-interleaved-1f1b":
        sched = ScheduleInterleaved1F1B(stages, num_microbatches, loss_fn=F.cross_entropy)
    else:
        schedule_cls = {"torch-gpipe": ScheduleGPipe, "torch-1f1b": Schedule1F1B}[schedule]
        sched = schedule_cls(stages[0], num_microbatches, F.cross_entropy)

    def step() -> tuple[float | None, None]:
        losses: list = []
        sched.step(
            *([x.to(device)] if first else []),
            **({"target": y.to(device), "losses": losses} if last else {}),
        )
        return (torch.stack(losses).mean().item() if last else None), None

    return step


def accumulation_across_steps(
    widths: Sequence[int],
    split_points: Sequence[int],
    seed: int,
    grid,
    x: torch.Tensor,
    y: torch.Tensor,
    m: int,
    device: torch.device,
) -> dict:
    """`ScheduleGPipe.step()` twice on one batch, no zero_grad, on this rank's stage (its "pp" coordinate of
    `grid`) of `mlp(widths)` cut at `split_points` (built afresh from `seed` each time): .grad's largest
    |difference| from (1 + 1/m) and from 2 times one call's g, relative to max |g|; and with scale_grads=False
    and the loss / 2m (the fix), from g."""
    stage_index, num_stages, group = grid.coords["pp"], grid.size("pp"), grid.group("pp")
    first, last = stage_index == 0, stage_index == num_stages - 1

    def loss_by_hand(out, target):  # scale_grads=False: the mean over 2 steps of m micro-batches
        return F.cross_entropy(out, target) / (2 * m)

    def grads_after(calls: int, scale_grads: bool = True) -> list[torch.Tensor]:
        torch.manual_seed(seed)  # the same start every time
        module = nn.Sequential(*split_model(mlp(widths), split_points)[stage_index]).to(device)
        stage = PipelineStage(module, stage_index, num_stages, device, group=group)
        loss_fn = F.cross_entropy if scale_grads else loss_by_hand
        sched = ScheduleGPipe(stage, m, loss_fn, scale_grads=scale_grads)
        for _ in range(calls):  # no zero_grad between the calls
            sched.step(
                *([x.to(device)] if first else []),
                **({"target": y.to(device)} if last else {}),
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
