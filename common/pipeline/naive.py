"""The naive model split (lesson 09's first section): two stages in ONE process, the batch through one and then
the other, checked against the unsplit model's step.

With two GPUs the stages sit on cuda:0 and cuda:1 and the activation crosses at the boundary; otherwise both sit
on one device ("simulated"). Either way only one device works at a time: the idle fraction is about 1/2, which is
what pipelining (`common.pipeline.schedules`, `common.pipeline.executor`) removes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.measure.differences import nan_max
from common.models import mlp
from common.pipeline.schedules import default_split_points, split_model
from common.pipeline.stage_timers import (
    SimulatedKernel,
    TimedStage,
    busy_overlap_s,
    measured_bubble,
)

__all__ = ["unsplit_step", "diff_from_unsplit", "naive_split"]

CPU = torch.device("cpu")


def unsplit_step(widths, x, y, lr: float, seed: int) -> dict:
    """The unsplit `mlp(widths)` on the whole batch, one process: loss, every gradient, parameters after SGD.

    What every split of lesson 09 is checked against: the model built from `seed`, the mean loss over the N
    samples, one SGD step of learning rate `lr`."""
    torch.manual_seed(seed)
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


def diff_from_unsplit(got: Sequence[dict], ref: dict) -> dict:
    """The stages of a pipelined step put back in model order, against `unsplit_step`'s result.

    Args:
        got: each pp rank's {"loss": on the last stage, "grads" / "params": {stage index: [tensors]}}.
    Returns:
        {"loss": the last stage's loss, "max_diff": the largest |difference| of loss, gradients and parameters
        after SGD from the unsplit step's, NaN if any is NaN}.
    """
    by_stage = {i: (r["grads"][i], r["params"][i]) for r in got for i in r["grads"]}
    mine = [t for k in (0, 1) for i in sorted(by_stage) for t in by_stage[i][k]]
    diffs = [
        (a - b).abs().max().item() for a, b in zip(mine, ref["grads"] + ref["params"], strict=True)
    ]
    return {
        "loss": got[-1]["loss"],
        "max_diff": nan_max([abs(got[-1]["loss"] - ref["loss"]), *diffs]),
    }


def naive_split(widths, x, y, stage_ms: float, seed: int, device=CPU, two_gpus=False) -> dict:
    """Two stages in ONE process, on cuda:0 and cuda:1 (two_gpus) or both on `device` ("simulated"): the batch
    goes through one, then the other. Returns devices, busy intervals, overlap, idle fraction, and the
    largest difference from the unsplit model's loss and gradients."""
    two_gpus = two_gpus and torch.cuda.device_count() >= 2
    devs = [torch.device("cuda:0"), torch.device("cuda:1")] if two_gpus else [device] * 2
    torch.manual_seed(seed)
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
    ref = unsplit_step(widths, x, y, 0.1, seed)
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
