"""Ranks with different amounts of work: lesson 12's exhibits (rank-0-only work, uneven batches, 2+ ranks),
and lesson 05's failure demos (evaluation through DDP on an empty shard, uneven shards without Join, a user
all-reduce inside Join).

The exhibits use `common.exhibits.collectives`' helpers: each broken collective runs in a fresh gloo group
bounded by --timeout-s (see `common.exhibits.frame`). Lesson 05's demos run on CPU in gloo groups of their own
with a short timeout, so that the wait ends; the one that aborts its process runs in a child world.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from common.data_parallel.samplers import UnpaddedDistributedSampler
from common.exhibits.collectives import TIMEOUT_TEXT, _ddp, _steps
from common.exhibits.frame import Ctx, exhibit
from common.harness.env import DistInfo
from common.harness.ranks import max_param_diff_across_ranks
from common.harness.session import barrier, gloo_group
from common.models import DigitsCNN
from common.run.launch import torchrun_command
from common.run.processes import run_command


@exhibit(
    "rank0_work_past_timeout",
    "collectives",
    min_world=2,
    lesson="03",
    symptom="Timed out waiting ...ms for recv operation to complete",
    cause="rank-0-only work longer than the collective timeout while the others wait in dist.barrier()",
    when="on every rank but 0, while rank 0 evaluates or saves",
    fix=(
        "common.harness.session.rank0_only: the others wait in a barrier of a group with "
        "a long timeout"
    ),
)
def rank0_work_past_timeout(ctx: Ctx) -> None:
    from common.harness.session import rank0_only

    work_s = ctx.timeout_s + 1.0  # rank 0's evaluation outlasts the timeout by 1 s
    g = ctx.group()

    def broken():
        if ctx.info.master_process:
            time.sleep(work_s)
        dist.barrier(group=g)

    o = ctx.attempt(broken)
    lines = ctx.outcomes(
        o,
        "symptom",
        f"  symptom: rank 0 works {work_s:g} s, the others wait in dist.barrier():",
        ranks=[1],
    )
    ctx.claim(
        "broken_rank1_times_out",
        int(TIMEOUT_TEXT in lines[1]) if lines else 1,
        "==",
        1,
        "rank 1 raises a timeout: {value}",
    )
    ctx.step("diagnosis", "the failing rank is not the slow one: look at what rank 0 was doing")

    def fixed() -> float:
        t0 = time.perf_counter()
        # the others wait without the timeout
        with rank0_only(ctx.info, "the exhibit's rank-0 work") as mine:
            if mine:
                time.sleep(work_s)
        return time.perf_counter() - t0

    o = ctx.attempt(fixed)
    waited = ctx.gather(o.value if not o.failed else float("nan"))
    ctx.step(
        "fix",
        "common.harness.session.rank0_only: the others wait in a barrier of a group with a long timeout",
    )
    ctx.claim(
        "fixed_finishes",
        sum(w == w for w in waited),
        "==",
        ctx.info.world_size if waited else 0,
        "ranks that passed the rank-0-only phase without error: {value}",
    )
    shortest = torch.tensor(waited or [work_s]).min().item()  # NaN stays NaN
    ctx.record("fixed_wait_s", shortest)
    ctx.report.perf(
        "rank0_work_past_timeout_fixed_wait_s", shortest, "the shortest wait: {value:.1f} s"
    )
    ctx.claim(
        "fixed_wait_past_timeout",
        int(shortest >= ctx.timeout_s),
        "==",
        1,
        "every rank waited longer than --timeout-s in that phase, without error: {value}",
    )


@exhibit(
    "uneven_batches_without_join",
    "collectives",
    min_world=2,
    lesson="05",
    symptom="Timed out waiting ...ms for recv operation to complete",
    cause="ranks have different numbers of batches; the last all-reduce has no partner",
    when="on the rank with more batches (without a timeout: a hang)",
    fix=(
        "with Join([ddp_model]): (lesson 05), or pad so every rank has the same number of batches"
    ),
)
def uneven_batches_without_join(ctx: Ctx) -> None:
    n = 3 if ctx.info.rank == 0 else 2  # an unpadded sampler: 3 batches on rank 0, 2 on the others
    o = ctx.attempt(_steps, _ddp(ctx.group()), n)
    lines = ctx.outcomes(o, "symptom", "  symptom: 3 batches on rank 0, 2 on the others:")
    ctx.claim(
        "broken_rank0_times_out",
        int(TIMEOUT_TEXT in lines[0]) if lines else 1,
        "==",
        1,
        "rank 0 times out in its third backward: {value}",
    )
    ctx.step(
        "diagnosis", "len(loader) differs between ranks: gather it and compare before training"
    )
    model = _ddp(ctx.group())
    with Join([model]):  # finished ranks shadow DDP's all-reduce for the others
        taken = _steps(model, n)
    ctx.step(
        "fix",
        "with Join([ddp_model]): (lesson 05), or pad so every rank has the same number of batches",
    )
    ctx.claim(
        "fixed_replicas_identical",
        max_param_diff_across_ranks(model, ctx.info),
        "==",
        0.0,
        "max |parameter difference| after Join: {value}",
    )
    ctx.record("fixed_steps", taken)  # 3 on rank 0, 2 on the others


@exhibit(
    "eval_through_ddp_on_empty_rank",
    "collectives",
    min_world=2,
    lesson="05",
    symptom="Timed out waiting ...ms for send operation to complete",
    cause="the DDP forward broadcasts buffers; the rank with no batch never joins it",
    when="in evaluation, when a rank's evaluation shard is empty",
    fix="evaluate ddp_model.module and all_reduce (sum, count) once",
)
def eval_through_ddp_on_empty_rank(ctx: Ctx) -> None:
    torch.manual_seed(0)
    g = ctx.group()
    model = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), process_group=g)  # has buffers
    model(
        torch.randn(3, 4)
    ).sum().backward()  # one training step: the next forward re-sends buffers
    batches = (
        [torch.ones(1, 4)] if ctx.info.rank == 0 else []
    )  # 1 sample: the other ranks' shards are empty

    def evaluate(net):
        net.eval()
        s = torch.zeros(2)  # (sum of outputs, count)
        with torch.no_grad():
            for x in batches:
                s += torch.tensor([net(x).sum().item(), float(len(x))])
        dist.all_reduce(s, group=g if net is model else gf)
        return s.tolist()

    o = ctx.attempt(evaluate, model)
    lines = ctx.outcomes(
        o,
        "symptom",
        "  symptom: evaluate through the DDP wrapper, 1 sample in all:",
        example=TIMEOUT_TEXT,
    )
    ctx.claim(
        "broken_raises",
        sum(not line.startswith("finished") for line in lines),
        "==",
        ctx.info.world_size,
        "ranks that raise in evaluation (a timeout, or the pair their peer closed): {value}",
    )
    ctx.step(
        "diagnosis",
        "rank 0 is in DDP's buffer broadcast, the others in the metric all_reduce (py-spy dump)",
    )
    gf = ctx.group()
    total = evaluate(model.module)  # the unwrapped module: no collective in forward
    ctx.step("fix", "evaluate ddp_model.module and all_reduce (sum, count) once")
    ctx.claim("fixed_count", total[1], "==", 1.0, "samples counted over all ranks: {value:g}")


# Lesson 05's failure demos ----------------------------------------------------------------------------------
def run_until_timeout(steps) -> dict:
    """Run the iterator `steps` to its end.

    Returns {"outcome": "finished" | "timed out" | the error, "steps", "seconds"}."""
    t0, outcome, done = time.perf_counter(), "finished", 0
    try:
        for _ in steps:
            done += 1
    except RuntimeError as e:
        # gloo: "Timed out waiting 2000ms for recv ..." or "Application timeout ..."
        timed_out = "time" in str(e).lower()
        outcome = "timed out" if timed_out else f"error: {type(e).__name__}: {str(e)[:200]}"
    return {"outcome": outcome, "steps": done, "seconds": time.perf_counter() - t0}


def ddp_eval_with_empty_shard(dataset, info: DistInfo, timeout_s: float) -> dict:
    """The mistake: evaluating through the DDP wrapper when a rank's shard is empty (len(dataset) < W).

    DDP's first forward (and the first after any training step) broadcasts rank 0's buffers; a rank with no
    batch never calls forward. On CPU in a gloo group of its own, so the wait ends after `timeout_s`."""
    group = gloo_group(timeout_s)
    # BatchNorm: its running statistics are the buffers DDP broadcasts
    model = DDP(DigitsCNN(), process_group=group).eval()
    sampler = UnpaddedDistributedSampler(dataset, info.world_size, info.rank)
    with torch.no_grad():
        out = run_until_timeout(model(x) for x, _ in DataLoader(dataset, sampler=sampler))
    barrier(info)  # the default group (timeout --timeout-s): everyone continues together
    return out


def train_without_join(loader, info: DistInfo, timeout_s: float) -> dict:
    """The mistake: lesson 05's loop without Join (CPU, gloo group with `timeout_s`): the rank with more
    batches waits in its extra step's all-reduce for a partner that never comes."""
    group = gloo_group(timeout_s)
    model = DDP(DigitsCNN(norm="none"), process_group=group)
    # one backward (one gradient all-reduce) per batch
    out = run_until_timeout(F.cross_entropy(model(x), y).backward() for x, y in loader)
    barrier(info)  # the default group (timeout --timeout-s): everyone continues together
    return out


def all_reduce_inside_join(model, raw_model, loader, info) -> None:
    """The mistake (run in lesson 05's child world): its train_with_join with a user all-reduce inside the
    loop. Rank 0 runs out first; its Join shadows DDP's collectives, which do not line up with rank 1's
    1-element all-reduce."""
    optimizer = torch.optim.SGD(raw_model.parameters(), lr=0.05)
    with Join([model]) if info.distributed else nullcontext():
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(info.device)), y.to(info.device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            dist.all_reduce(loss.detach())  # breaks: a collective Join knows nothing about


def all_reduce_inside_join_child(seed: int, timeout_s: float) -> list[str]:
    """Launch lesson 05's child world: 2 gloo processes run `all_reduce_inside_join`.

    Its own torchrun, because the failing process aborts (which would end the caller's world). Returns the
    gloo errors it printed, [] if it exited 0."""
    args = ["--child", "all-reduce-in-join", "--device", "cpu", "--backend", "gloo"]
    args += ["--timeout-s", str(timeout_s), "--hang-timeout-s", str(timeout_s / 2)]
    child = run_command(torchrun_command("05_uneven_data", 2, [*args, "--seed", str(seed)]), 180)
    errors = ("doesn't match expected size", "timed out")
    return [w for w in errors if w in child.stderr.lower()] if child.returncode else []
