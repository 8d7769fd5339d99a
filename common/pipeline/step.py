"""One recorded training step of a rank's pipeline stages under any of lesson 09's schedules: the hand-written
GPipe and 1F1B (`common.pipeline.executor`) or torch's ScheduleGPipe, Schedule1F1B and ScheduleInterleaved1F1B
(`common.pipeline.torch_schedules`), timed by `common.pipeline.stage_timers`, then one SGD step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from common.models import mlp
from common.pipeline.executor import executor_step
from common.pipeline.naive import diff_from_unsplit
from common.pipeline.schedules import (
    default_split_points,
    interleaved_stage_indices,
    microbatch_sizes,
    peak_live_in_order,
    schedule_order,
    split_model,
    theory_bubble,
)
from common.pipeline.stage_timers import peak_live, record_step, timed_stages
from common.pipeline.torch_schedules import torch_schedule_step

__all__ = ["recorded_pipeline_step", "step_row"]

# what a row keeps of each rank's step, one list entry per rank
PER_RANK = ("peak_live", "peak_live_in_order", "peak_activation_bytes", "events")


def recorded_pipeline_step(
    schedule: str,
    grid,
    x: torch.Tensor,
    y: torch.Tensor,
    m: int,
    *,
    widths: Sequence[int],
    split_points: Sequence[int],
    seed: int,
    lr: float,
    stage_ms: float,
    device: torch.device,
    barrier: Callable[[], None],
    stages_per_rank: int = 2,
) -> dict:
    """One SGD step of this rank's stage(s) of `mlp(widths)` under `schedule` with m micro-batches.

    Every rank builds the whole model from `seed` and keeps its stages: stage pp_rank of the cut at
    `split_points`, or, for "torch-interleaved-1f1b", stages pp_rank + k p of an even cut into p x
    `stages_per_rank`. A warm-up step runs with the simulated kernel off, then the recorded one with `stage_ms`
    per batch (a rank's stages share it); `grid` gives "pp"'s size, coords, ranks and group.

    Returns what this rank saw: the loss (last stage), its events, gradients and parameters after SGD by stage
    index, its peak activation bytes (hand-written executor only), v, and the micro-batches it held at once,
    measured and as the order says.
    """
    p, pp_rank = grid.size("pp"), grid.coords["pp"]
    v = stages_per_rank if schedule.endswith("interleaved-1f1b") else 1
    indices = interleaved_stage_indices(p, v, pp_rank)  # [pp_rank] when v == 1
    torch.manual_seed(seed)  # the same whole model on every rank
    model = mlp(widths)
    parts = split_model(model, split_points if v == 1 else default_split_points(model, p * v))
    timed = timed_stages(parts, indices, device)
    sizes, order = microbatch_sizes(len(x), m), schedule_order(schedule, m, p, pp_rank, v)
    if schedule in ("gpipe", "1f1b"):  # send/recv in the schedule's order
        step = executor_step(timed[0], order, pp_rank, grid.ranks_in("pp"), sizes, x, y, device)
    else:
        step = torch_schedule_step(
            schedule, timed, indices, p * v, m, grid.group("pp"), x, y, device
        )
    (loss, peak_bytes), events = record_step(step, timed, barrier, stage_ms / len(x) / v)
    grads = {t.stage_index: [q.grad.detach().cpu().clone() for q in t.parameters()] for t in timed}
    torch.optim.SGD([q for t in timed for q in t.parameters()], lr=lr).step()
    params = {t.stage_index: [q.detach().cpu().clone() for q in t.parameters()] for t in timed}
    return {
        "loss": loss,
        "events": events,
        "grads": grads,
        "peak_activation_bytes": peak_bytes,
        "v": v,
        "params": params,
        "peak_live": peak_live(events),
        "peak_live_in_order": peak_live_in_order(order),
    }


def step_row(schedule: str, m: int, got: Sequence[dict], ref: dict) -> dict:
    """Rank 0's row of one pipelined step, from every pp rank's `recorded_pipeline_step` (`got`, in pp order) and
    `unsplit_step`'s `ref`: the loss and largest difference from the unsplit step, the bubble theory predicts,
    and each rank's peak live micro-batches (measured and as ordered), peak activation bytes and events."""
    return {
        "schedule": schedule,
        "m": m,
        **diff_from_unsplit(got, ref),
        "theory_bubble": theory_bubble(len(got), m, got[0]["v"]),
        **{k: [r[k] for r in got] for k in PER_RANK},
    }
