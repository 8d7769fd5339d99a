"""torch.compile of a DDP model, counted: how many graphs DDPOptimizer cuts, and its rule (lesson 17, section 3).

DDPOptimizer (torch/_dynamo/backends/distributed.py) cuts the compiled forward where DDP's buckets end, so that
with an AOTAutograd backend (inductor) each bucket's backward ends, and its all-reduce can start, before the
rest of backward. torch 2.13 builds it from DDP's `bucket_bytes_cap` alone (torch/_dynamo/convert_frame.py), so
its first graph always closes at 1 MiB (`dist._DEFAULT_FIRST_BUCKET_BYTES`) whatever DDP's first bucket is, and
it refuses a cap below 1 MiB: AssertionError("First bucket should be smaller/equal to other buckets to get
comms warmed up ASAP"). So graphs equal DDP's buckets where DDP's first bucket is 1 MiB too: bucket_cap_mb=None
(DDP's default) or 1.
"""

from __future__ import annotations

import time

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F

from common.performance.buckets import predicted_buckets

__all__ = ["compiled_graphs", "graphs_by_cap", "refusal_below_1mib"]


def compiled_graphs(model, batch, optimize_ddp: bool, backend: str) -> tuple[int, float, float]:
    """(graphs compiled, seconds of the first step = compile, seconds of the second step) for torch.compile."""
    graphs, times = [], []

    def counting_backend(gm, example_inputs):  # called once per graph dynamo hands over
        graphs.append(gm)
        if backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        return gm.forward  # eager: run the captured graph as it is

    torch._dynamo.reset()
    with torch._dynamo.config.patch(optimize_ddp=optimize_ddp):
        compiled = torch.compile(model, backend=counting_backend)
        for _ in range(2):
            t0 = time.perf_counter()
            F.cross_entropy(compiled(batch[0]), batch[1]).backward()
            times.append(time.perf_counter() - t0)
    return len(graphs), times[0], times[1]


def graphs_by_cap(make_ddp, batch, caps=(None, 1.0, 25.0)) -> dict:
    """{str(cap): [graphs, DDP's buckets, DDP's rule with a 1 MiB first bucket]}, each counted with the eager
    backend (the split does not depend on the backend); `make_ddp(cap)` builds the DDP model."""
    rows = {}
    for cap in caps:
        model = make_ddp(cap)
        rows[str(cap)] = [
            compiled_graphs(model, batch, True, "eager")[0],
            predicted_buckets(model),
            predicted_buckets(model, first_bucket_bytes=dist._DEFAULT_FIRST_BUCKET_BYTES),
        ]
    return rows


def refusal_below_1mib(model, batch) -> str:
    """The AssertionError text torch.compile raises for a DDP `model` whose bucket_cap_mb is below 1 ("" if it
    compiles)."""
    try:
        compiled_graphs(model, batch, True, "eager")
    except AssertionError as e:  # DDPOptimizer: its 1 MiB first bucket may not exceed the others
        return str(e)
    return ""
