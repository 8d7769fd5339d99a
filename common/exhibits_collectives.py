"""Lesson 12's exhibits of collectives that ranks do not all join: hangs, mismatches, uneven work (2 ranks).
Each broken collective runs in a fresh gloo group bounded by --timeout-s (`Ctx.group`), so it raises where a
real job would hang; the mismatch that kills a gloo process runs as its own launch. See `common.exhibits`.
"""
from __future__ import annotations

import re
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from common.exhibits import Ctx, exhibit, first_line
from common.ranks import max_param_diff_across_ranks

TIMEOUT_TEXT = "Timed out waiting"  # gloo's words when a collective's peer never comes


def _fingerprint(message: str) -> str:
    """'Rank R is running collective: OpType=..., TensorShape=[...]' from a DETAIL mismatch message."""
    m = re.search(r"(Rank \d+ is running collective): CollectiveFingerPrint\(.*?(OpType=\w+), "
                  r"(TensorShape=\[[^\]]*\])", message)
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


@exhibit("mismatched_collectives", "collectives", min_world=2, lesson="02",
         symptom="terminate called after throwing an instance of 'gloo::EnforceNotMet' ... Received data size "
                 "doesn't match expected size. Is there a distributed collective mismatch in your code?",
         cause="ranks call all_reduce with different shapes (or a different collective)")
def mismatched_collectives(ctx: Ctx) -> None:
    rank = ctx.info.rank
    with ctx.rank0("launch the mismatch") as mine:  # gloo aborts the process: a launch of its own
        if mine:
            code, out = ctx.launch([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    "--nproc_per_node=2", "-m", "common.exhibits_worker", "shapes", "10"], 60)
            lines = [first_line(out, "terminate called"), first_line(out, "Received data size", limit=220)]
            ctx.step("symptom", "rank 0 all_reduces 4 floats, rank 1 8 floats (a launch of its own); gloo says")
            for line in lines:
                ctx.say(f"    {line}")
            ctx.record("symptom", lines)
            ctx.claim("broken_aborts", int(code != 0 and "collective mismatch" in out), "==", 1,
                      "the launch fails with gloo's size-mismatch abort: {value}")
    g = ctx.group()  # a different collective on each rank: no abort, both wait until --timeout-s
    t = torch.ones(4)
    o = ctx.attempt(lambda: dist.all_reduce(t, group=g) if rank == 0 else dist.broadcast(t, 0, group=g))
    lines = ctx.outcomes(o, "symptom_op", "  symptom: all_reduce on rank 0, broadcast on rank 1:",
                         example=TIMEOUT_TEXT)
    ctx.claim("op_mismatch_raises", sum(not l.startswith("finished") for l in lines), "==", 2,
              "ranks that raise (a timeout, or the pair their peer closed) instead of hanging: {value}")
    gd = ctx.group(detail=True)
    t = torch.ones(4 if rank == 0 else 8)
    o = ctx.attempt(lambda: dist.all_reduce(t, group=gd))
    ctx.say("  diagnosis: the same all_reduce with TORCH_DISTRIBUTED_DEBUG=DETAIL names each rank's op and shape:")
    fingerprints = [_fingerprint(full) for full in ctx.gather(o.full)]
    for r, f in enumerate(fingerprints):
        ctx.say(f"    [rank {r}] Detected mismatch between collectives on ranks. {f}")
    ctx.record("diagnosis_detail", fingerprints)
    ctx.claim("detail_names_shapes", int(ctx.info.master_process and fingerprints == [
        "Rank 0 is running collective: OpType=ALLREDUCE, TensorShape=[4]",
        "Rank 1 is running collective: OpType=ALLREDUCE, TensorShape=[8]"]), "==", int(ctx.info.master_process),
        "DETAIL names rank 0's shape [4] and rank 1's shape [8]: {value}")
    gm = ctx.group()
    o = ctx.attempt(lambda: dist.monitored_barrier(
        group=gm, timeout=timedelta(seconds=ctx.timeout_s), wait_all_ranks=True) if rank == 0
                    else time.sleep(ctx.timeout_s + 0.5))  # rank 1 is stuck elsewhere
    lines = ctx.outcomes(o, "diagnosis_monitored", "  diagnosis: dist.monitored_barrier on rank 0 names the rank "
                         "that did not arrive:", ranks=[0])
    ctx.claim("monitored_barrier_names_rank_1", int("Ranks 1 failed to pass monitoredBarrier" in lines[0])
              if lines else 0, "==", int(ctx.info.master_process), "monitored_barrier names rank 1: {value}")
    gf = ctx.group()
    mine = torch.arange(4.0 if rank == 0 else 8.0)
    n = torch.tensor([mine.numel()])
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=gf)  # agree on one shape first ...
    padded = torch.zeros(int(n)); padded[:mine.numel()] = mine
    dist.all_reduce(padded, group=gf)                     # ... then every rank calls the same collective
    ctx.step("fix", "agree on the shape first (all_reduce of the length with MAX), pad, then all_reduce")
    ctx.claim("fixed_sum", padded.sum().item(), "==", float(sum(range(4)) + sum(range(8))),
              "sum over both ranks of arange(4) and arange(8): {value:g}")


@exhibit("rank_skips_step", "collectives", min_world=2, lesson="05",
         symptom="Timed out waiting ...ms for recv operation to complete (one rank), while another rank "
                 "finishes without error",
         cause="one rank `continue`s past a bad batch alone; its next backward pairs with the others' current one")
def rank_skips_step(ctx: Ctx) -> None:
    bad = {1} if ctx.info.rank == 1 else set()  # rank 1 finds step 1's batch unusable
    model = _ddp(ctx.group())
    o = ctx.attempt(_steps, model, 3, bad)
    lines = ctx.outcomes(o, "symptom", "  symptom: rank 1 skips step 1 on its own, 3 DDP steps:")
    ctx.claim("broken_times_out", sum(TIMEOUT_TEXT in l for l in lines), ">=", 1,
              "ranks that time out in backward: {value}")
    ctx.step("diagnosis", "rank 1 'finished' 2 steps: its step-2 all-reduce was paired with rank 0's step 1")
    model = _ddp(ctx.group())
    skip = torch.tensor([1.0 if bad else 0.0])
    dist.all_reduce(skip, op=dist.ReduceOp.MAX, group=model.process_group)  # one flag, agreed by every rank
    agreed = {1} if skip.item() > 0 else set()
    taken = _steps(model, 3, agreed)
    ctx.step("fix", "all_reduce a skip flag with MAX before the step: every rank skips step 1 together")
    counts = ctx.gather(taken)  # every rank calls it; rank 0 gets [2, 2]
    ctx.claim("fixed_steps_equal", len(set(counts)) if counts else 1, "==", 1,
              "distinct numbers of steps taken over the ranks (every rank took 2): {value}")
    ctx.claim("fixed_replicas_identical", max_param_diff_across_ranks(model, ctx.info), "==", 0.0,
              "max |parameter difference| across ranks after the agreed skip: {value}")


class _TwoHeads(nn.Module):
    """`aux` is built but not used in forward: DDP waits for its gradient forever."""

    def __init__(self):
        super().__init__()
        self.used, self.aux = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def _unused_run(group, steps: int = 2, **kw) -> float:
    torch.manual_seed(0)
    model = DDP(_TwoHeads(), process_group=group, **kw)
    t0 = time.perf_counter()
    _steps(model, steps)
    return (time.perf_counter() - t0) / steps


@exhibit("unused_parameter", "collectives", min_world=2, lesson="03",
         symptom="RuntimeError: Expected to have finished reduction in the prior iteration before starting a new "
                 "one. This error indicates that your module has parameters that were not used in producing loss.",
         cause="a parameter gets no gradient, so DDP's reducer never finishes its bucket")
def unused_parameter(ctx: Ctx) -> None:
    o = ctx.attempt(_unused_run, ctx.group())
    lines = ctx.outcomes(o, "symptom", "  symptom: a module with an unused head, second iteration:")
    ctx.claim("broken_raises", sum("Expected to have finished reduction" in l for l in lines), "==", 2,
              "ranks raising 'Expected to have finished reduction': {value}")
    torch.manual_seed(0)
    m = _TwoHeads()
    m(torch.randn(3, 4)).sum().backward()
    unused = [n for n, p in m.named_parameters() if p.grad is None]
    ctx.step("diagnosis", f"parameters with grad None after one backward: {unused} (the error lists their "
             "indices; TORCH_DISTRIBUTED_DEBUG=DETAIL names them)")
    ctx.record("unused", unused)
    for kw in ({"find_unused_parameters": True}, {"static_graph": True}):
        name = next(iter(kw))
        ms = _unused_run(ctx.group(), 20, **kw)
        ctx.report.perf(f"unused_parameter_{name}_ms", ms * 1e3, f"{name}=True: {{value:.2f}} ms per step")
    ctx.step("fix", "find_unused_parameters=True (walks the graph every step) or static_graph=True (learns it "
             "once); best: delete the unused module; both train 20 steps without error")
    ctx.claim("fixed_trains", 1, "==", 1, "find_unused_parameters and static_graph both train: {value}")


@exhibit("rank0_work_past_timeout", "collectives", min_world=2, lesson="03",
         symptom="Timed out waiting ...ms for recv operation to complete, on every rank but 0, while rank 0 "
                 "evaluates or saves",
         cause="rank-0-only work longer than the collective timeout while the others wait in dist.barrier()")
def rank0_work_past_timeout(ctx: Ctx) -> None:
    from common.session import rank0_only
    work_s = ctx.timeout_s + 1.0  # rank 0's evaluation outlasts the timeout by 1 s
    g = ctx.group()

    def broken():
        if ctx.info.master_process:
            time.sleep(work_s)
        dist.barrier(group=g)
    o = ctx.attempt(broken)
    lines = ctx.outcomes(o, "symptom", f"  symptom: rank 0 works {work_s:g} s, rank 1 waits in dist.barrier():",
                         ranks=[1])
    ctx.claim("broken_rank1_times_out", int(TIMEOUT_TEXT in lines[1]) if lines else 1, "==", 1,
              "rank 1 raises a timeout: {value}")
    ctx.step("diagnosis", "the failing rank is not the slow one: look at what rank 0 was doing")
    with rank0_only(ctx.info, "the exhibit's rank-0 work") as mine:  # the others wait without the timeout
        if mine:
            time.sleep(work_s)
    ctx.step("fix", "common.session.rank0_only: the others wait in a barrier of a group with a long timeout")
    ctx.claim("fixed_finishes", 1, "==", 1, "every rank passed the rank-0-only phase: {value}")


@exhibit("uneven_batches_without_join", "collectives", min_world=2, lesson="05",
         symptom="Timed out waiting ...ms for recv operation to complete on the rank with more batches "
                 "(or a hang without timeout)",
         cause="ranks have different numbers of batches; the last all-reduce has no partner")
def uneven_batches_without_join(ctx: Ctx) -> None:
    n = 3 if ctx.info.rank == 0 else 2  # an unpadded sampler: 3 batches on rank 0, 2 on rank 1
    o = ctx.attempt(_steps, _ddp(ctx.group()), n)
    lines = ctx.outcomes(o, "symptom", "  symptom: 3 batches on rank 0, 2 on rank 1:")
    ctx.claim("broken_rank0_times_out", int(TIMEOUT_TEXT in lines[0]) if lines else 1, "==", 1,
              "rank 0 times out in its third backward: {value}")
    ctx.step("diagnosis", "len(loader) differs between ranks: gather it and compare before training")
    model = _ddp(ctx.group())
    with Join([model]):  # finished ranks shadow DDP's all-reduce for the others
        taken = _steps(model, n)
    ctx.step("fix", "with Join([ddp_model]): (lesson 05), or pad so every rank has the same number of batches")
    ctx.claim("fixed_replicas_identical", max_param_diff_across_ranks(model, ctx.info), "==", 0.0,
              "max |parameter difference| after Join: {value}")
    ctx.record("fixed_steps", taken)  # 3 on rank 0, 2 on rank 1


@exhibit("eval_through_ddp_on_empty_rank", "collectives", min_world=2, lesson="05",
         symptom="evaluation hangs until the timeout (Timed out waiting ...ms for send operation to complete) "
                 "when a rank's evaluation shard is empty",
         cause="the DDP forward broadcasts buffers; the rank with no batch never joins it")
def eval_through_ddp_on_empty_rank(ctx: Ctx) -> None:
    torch.manual_seed(0)
    g = ctx.group()
    model = DDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), process_group=g)  # has buffers
    model(torch.randn(3, 4)).sum().backward()  # one training step: the next forward re-sends buffers
    batches = [torch.ones(1, 4)] if ctx.info.rank == 0 else []  # 1 sample, 2 ranks: rank 1's shard is empty

    def evaluate(net):
        net.eval()
        s = torch.zeros(2)  # (sum of outputs, count)
        with torch.no_grad():
            for x in batches:
                s += torch.tensor([net(x).sum().item(), float(len(x))])
        dist.all_reduce(s, group=g if net is model else gf)
        return s.tolist()
    o = ctx.attempt(evaluate, model)
    lines = ctx.outcomes(o, "symptom", "  symptom: evaluate through the DDP wrapper, 1 sample on 2 ranks:",
                         example=TIMEOUT_TEXT)
    ctx.claim("broken_raises", sum(not l.startswith("finished") for l in lines), "==", 2,
              "ranks that raise in evaluation (a timeout, or the pair their peer closed): {value}")
    ctx.step("diagnosis", "rank 0 is in DDP's buffer broadcast, rank 1 in the metric all_reduce (py-spy dump)")
    gf = ctx.group()
    total = evaluate(model.module)  # the unwrapped module: no collective in forward
    ctx.step("fix", "evaluate ddp_model.module and all_reduce (sum, count) once")
    ctx.claim("fixed_count", total[1], "==", 1.0, "samples counted over both ranks: {value:g}")
