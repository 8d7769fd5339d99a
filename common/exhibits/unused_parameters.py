"""Lesson 12's exhibit of a parameter that gets no gradient under DDP: the error, and the cost of
find_unused_parameters=True."""

from __future__ import annotations

import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.exhibits.collectives import _steps
from common.exhibits.frame import Ctx, exhibit

__all__ = ["unused_parameter"]


class _TwoHeads(nn.Module):
    """`aux` is built but not used in forward: DDP waits for its gradient forever."""

    def __init__(self):
        super().__init__()
        self.used, self.aux = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def _unused_run(group, steps: int = 2, debug: bool = False, **kw) -> float:
    """`steps` steps of a DDP model with an unused head; returns seconds per step.

    debug=True builds the DDP model as TORCH_DISTRIBUTED_DEBUG=INFO would (DDP reads the level when built).
    """
    torch.manual_seed(0)
    if debug:
        dist.set_debug_level(dist.DebugLevel.INFO)
    try:
        model = DDP(_TwoHeads(), process_group=group, **kw)
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)
    t0 = time.perf_counter()
    taken = _steps(model, steps)
    return (time.perf_counter() - t0) / taken


def _named_in_error(full: str) -> str:
    """'aux.bias, aux.weight' from 'Parameters which did not receive grad for rank R: aux.bias, ...'."""
    m = re.search(r"Parameters which did not receive grad for rank \d+: ([\w., ]+)", full)
    return m.group(1).strip() if m else ""


@exhibit(
    "unused_parameter",
    "collectives",
    min_world=2,
    lesson="03",
    symptom="RuntimeError: Expected to have finished reduction in the prior "
    "iteration before starting a new one. This error indicates that "
    "your module has parameters that were not used in producing loss.",
    cause="a parameter gets no gradient, so DDP's reducer never finishes its bucket",
    fix="find_unused_parameters=True (walks the graph every step) or static_graph=True",
)
def unused_parameter(ctx: Ctx) -> None:
    o = ctx.attempt(_unused_run, ctx.group())
    lines = ctx.outcomes(o, "symptom", "  symptom: a module with an unused head, second iteration:")
    ctx.claim(
        "broken_raises",
        sum("Expected to have finished reduction" in line for line in lines),
        "==",
        ctx.info.world_size,
        "ranks raising 'Expected to have finished reduction': {value}",
    )
    o = ctx.attempt(_unused_run, ctx.group(), debug=True)
    named = ctx.gather(_named_in_error(o.full))
    ctx.step(
        "diagnosis",
        "the error lists parameter indices (2 3); with "
        "TORCH_DISTRIBUTED_DEBUG=INFO (or DETAIL) "
        f"it names them: {named[0] if named else ''}",
    )
    ctx.record("unused", named)
    ctx.claim(
        "info_names_aux",
        sum(n == "aux.bias, aux.weight" for n in named),
        "==",
        ctx.info.world_size if named else 0,
        "ranks whose INFO error names aux.bias, aux.weight: {value}",
    )
    finished = 0
    for kw in ({"find_unused_parameters": True}, {"static_graph": True}):
        name = next(iter(kw))
        o = ctx.attempt(_unused_run, ctx.group(), 20, **kw)
        finished += int(not o.failed)
        if not o.failed:
            ctx.report.perf(
                f"unused_parameter_{name}_ms",
                o.value * 1e3,
                "{option}=True: {value:.2f} ms per step",
                option=name,
            )
    ctx.step(
        "fix",
        "find_unused_parameters=True (walks the graph "
        "every step) or static_graph=True (learns it "
        "once); best: delete the unused module",
    )
    counts = ctx.gather(finished)
    ctx.claim(
        "fixed_trains",
        sum(counts),
        "==",
        2 * ctx.info.world_size if counts else 0,
        "(setting, rank) pairs that trained 20 steps without error: {value}",
    )
