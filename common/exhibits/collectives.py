"""Lesson 12's exhibits of collectives that ranks do not all join: hangs, mismatches, uneven work (2+ ranks).
Each broken collective runs in a fresh gloo group bounded by --timeout-s (`Ctx.group`), so it raises where a
real job would hang; the mismatch that kills a gloo process runs as its own launch. See `common.exhibits.frame`;
the unused parameter is in `common.exhibits.unused_parameters`.
Rank 0 (or rank 1) plays the odd one out; every other rank behaves alike, so each count follows world_size.
"""

from __future__ import annotations

import re
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.exhibits.frame import Ctx, exhibit, first_line
from common.harness.ranks import max_param_diff_across_ranks

TIMEOUT_TEXT = "Timed out waiting"  # gloo's words when a collective's peer never comes


def _fingerprint(message: str) -> str:
    """'Rank R is running collective: OpType=..., TensorShape=[...]' from a DETAIL mismatch message."""
    m = re.search(
        r"(Rank \d+ is running collective): "
        r"CollectiveFingerPrint\(.*?(OpType=\w+), (TensorShape=\[[^\]]*\])",
        message,
    )
    return ", ".join(m.groups()).replace("collective,", "collective:") if m else message[:120]


def _ddp(group, seed: int = 0, **kw) -> DDP:
    torch.manual_seed(seed)
    return DDP(nn.Linear(4, 2), process_group=group, **kw)  # 10 parameters, one bucket


def _steps(model: DDP, n: int, skip: set[int] = frozenset(), seed: int = 1) -> int:
    """n SGD steps on batches (3, 4) of this rank; steps in `skip` are skipped; returns the steps taken."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    taken = 0
    for step in range(n):
        x = torch.randn(3, 4, generator=gen)
        if step in skip:
            continue
        opt.zero_grad()
        model(x).square().mean().backward()  # DDP all-reduces the gradient here
        opt.step()
        taken += 1
    return taken


@exhibit(
    "mismatched_collectives",
    "collectives",
    min_world=2,
    lesson="02",
    symptom="terminate called after throwing an instance of "
    "'gloo::EnforceNotMet' ... Received data size doesn't match expected "
    "size. Is there a distributed collective mismatch in your code?",
    cause="ranks call all_reduce with different shapes (or a different collective)",
    fix=("agree on the shape first (all_reduce of the length with MAX), pad, then all_reduce"),
)
def mismatched_collectives(ctx: Ctx) -> None:
    with ctx.rank0("launch the mismatch") as mine:  # gloo aborts the process: a launch of its own
        if mine:
            code, out = ctx.launch(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc_per_node=2",
                    "-m",
                    "common.exhibits.worker",
                    "shapes",
                    "10",
                ],
                60,
            )
            lines = [
                first_line(out, "terminate called"),
                first_line(out, "Received data size", limit=220),
            ]
            ctx.step(
                "symptom",
                "rank 0 all_reduces 4 floats, rank 1 8 floats (a launch of its own); gloo says",
            )
            for line in lines:
                ctx.say(f"    {line}")
            ctx.record("symptom", lines)
            ctx.claim(
                "broken_aborts",
                int(code != 0 and "collective mismatch" in out),
                "==",
                1,
                "the launch fails with gloo's size-mismatch abort: {value}",
            )
    _op_and_shape_mismatch(ctx)
    _fixed_by_agreeing_on_the_shape(ctx)


def _op_and_shape_mismatch(ctx: Ctx) -> None:
    rank, world = ctx.info.rank, ctx.info.world_size
    g = (
        ctx.group()
    )  # a different collective on rank 0: no abort, every rank waits until --timeout-s
    t = torch.ones(4)
    o = ctx.attempt(
        lambda: dist.all_reduce(t, group=g) if rank == 0 else dist.broadcast(t, 0, group=g)
    )
    lines = ctx.outcomes(
        o,
        "symptom_op",
        "  symptom: all_reduce on rank 0, broadcast on the others:",
        example=TIMEOUT_TEXT,
    )
    ctx.claim(
        "op_mismatch_raises",
        sum(not line.startswith("finished") for line in lines),
        "==",
        world,
        "ranks that raise (a timeout, or the pair their peer closed) instead of hanging: {value}",
    )
    gd = ctx.group(detail=True)
    t = torch.ones(4 if rank == 0 else 8)
    o = ctx.attempt(lambda: dist.all_reduce(t, group=gd))
    ctx.say(
        "  diagnosis: the same all_reduce with "
        "TORCH_DISTRIBUTED_DEBUG=DETAIL names each rank's op and shape:"
    )
    fingerprints = [_fingerprint(full) for full in ctx.gather(o.full)]
    for r, f in enumerate(fingerprints):
        ctx.say(f"    [rank {r}] Detected mismatch between collectives on ranks. {f}")
    ctx.record("diagnosis_detail", fingerprints)
    expected = [
        f"Rank {r} is running collective: OpType=ALLREDUCE, TensorShape=[{4 if r == 0 else 8}]"
        for r in range(world)
    ]
    ctx.claim(
        "detail_names_shapes",
        int(ctx.info.master_process and fingerprints == expected),
        "==",
        int(ctx.info.master_process),
        "DETAIL names rank 0's shape [4] and the others' [8]: {value}",
    )
    _monitored_barrier_names_the_others(ctx)


def _monitored_barrier_names_the_others(ctx: Ctx) -> None:
    """The second diagnosis: rank 0 in dist.monitored_barrier while the other ranks are stuck elsewhere."""
    rank, world = ctx.info.rank, ctx.info.world_size
    gm = ctx.group()
    o = ctx.attempt(
        lambda: (
            dist.monitored_barrier(
                group=gm, timeout=timedelta(seconds=ctx.timeout_s), wait_all_ranks=True
            )
            if rank == 0
            else time.sleep(ctx.timeout_s + 0.5)
        )
    )  # the other ranks are stuck elsewhere
    lines = ctx.outcomes(
        o,
        "diagnosis_monitored",
        "  diagnosis: dist.monitored_barrier on rank 0 names the ranks that did not arrive:",
        ranks=[0],
    )
    missing = ", ".join(str(r) for r in range(1, world))
    ctx.claim(
        "monitored_barrier_names_the_others",
        int(f"Ranks {missing} failed to pass monitoredBarrier" in lines[0]) if lines else 0,
        "==",
        int(ctx.info.master_process),
        "monitored_barrier names ranks {missing}: {value}",
        missing=missing,
    )


def _fixed_by_agreeing_on_the_shape(ctx: Ctx) -> None:
    gf = ctx.group()
    mine = torch.arange(4.0 if ctx.info.rank == 0 else 8.0)
    n = torch.tensor([mine.numel()])
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=gf)  # agree on one shape first ...
    padded = torch.zeros(int(n))
    padded[: mine.numel()] = mine
    dist.all_reduce(padded, group=gf)  # ... then every rank calls the same collective
    ctx.step(
        "fix", "agree on the shape first (all_reduce of the length with MAX), pad, then all_reduce"
    )
    expected = sum(range(4)) + (ctx.info.world_size - 1) * sum(range(8))
    ctx.claim(
        "fixed_sum",
        padded.sum().item(),
        "==",
        float(expected),
        "sum over the ranks of arange(4) (rank 0) and arange(8) (the others): {value:g}",
    )


@exhibit(
    "rank_skips_step",
    "collectives",
    min_world=2,
    lesson="05",
    symptom="Timed out waiting ...ms for recv operation to complete",
    cause="one rank `continue`s past a bad batch alone; its "
    "next backward pairs with the others' current one",
    when="on one rank, while another rank finishes without error",
    fix="all_reduce a skip flag with MAX before the step",
)
def rank_skips_step(ctx: Ctx) -> None:
    bad = {1} if ctx.info.rank == 1 else set()  # rank 1 finds step 1's batch unusable
    model = _ddp(ctx.group())
    o = ctx.attempt(_steps, model, 3, bad)
    lines = ctx.outcomes(o, "symptom", "  symptom: rank 1 skips step 1 on its own, 3 DDP steps:")
    ctx.claim(
        "broken_times_out",
        sum(TIMEOUT_TEXT in line for line in lines),
        ">=",
        1,
        "ranks that time out in backward: {value}",
    )
    ctx.step(
        "diagnosis",
        "rank 1 'finished' 2 steps: its step-2 all-reduce was paired with rank 0's step 1",
    )
    model = _ddp(ctx.group())
    skip = torch.tensor([1.0 if bad else 0.0])
    dist.all_reduce(
        skip, op=dist.ReduceOp.MAX, group=model.process_group
    )  # one flag, agreed by every rank
    agreed = {1} if skip.item() > 0 else set()
    taken = _steps(model, 3, agreed)
    ctx.step(
        "fix", "all_reduce a skip flag with MAX before the step: every rank skips step 1 together"
    )
    counts = ctx.gather(taken)  # every rank calls it; rank 0 gets [2, 2]
    ctx.claim(
        "fixed_steps_equal",
        len(set(counts)) if counts else 1,
        "==",
        1,
        "distinct numbers of steps taken over the ranks (every rank took 2): {value}",
    )
    ctx.claim(
        "fixed_replicas_identical",
        max_param_diff_across_ranks(model, ctx.info),
        "==",
        0.0,
        "max |parameter difference| across ranks after the agreed skip: {value}",
    )
