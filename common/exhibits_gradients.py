"""Lesson 12's exhibits of gradient mistakes: accumulation under DDP, GradScaler, a NaN on one rank.

DDP runs on a fresh gloo group per version (`Ctx.group`); see `common.exhibits` for the frame.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.counters import CommCounter
from common.exhibits import Ctx, exhibit
from common.ranks import max_param_diff_across_ranks


def _accum_grad(group, k: int, no_sync_forward: bool, divide: bool) -> tuple[int, torch.Tensor]:
    """k micro-steps of a DDP model; returns (gradient all-reduces, the gradient of weight)."""
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1, bias=False), process_group=group)
    counter = CommCounter().register(model)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    for micro_step in range(k):
        x = torch.randn(2, 4, generator=gen)
        last = micro_step == k - 1
        if no_sync_forward and not last:
            with model.no_sync():  # forward AND backward inside: no all-reduce
                loss = model(x).square().mean() / (k if divide else 1)
                loss.backward()
            continue
        loss = model(x).square().mean() / (k if divide else 1)
        if not last:
            with model.no_sync():  # only the backward inside: DDP still all-reduces (the forward armed it)
                loss.backward()
        else:
            loss.backward()
    return counter.calls, model.module.weight.grad.clone()


@exhibit("no_sync_around_backward_only", "training", min_world=2, lesson="07",
         symptom="gradient accumulation is as slow as no accumulation: one all-reduce per micro-step",
         cause="no_sync() wraps loss.backward() only; the forward outside it already armed the all-reduce")
def no_sync_around_backward_only(ctx: Ctx) -> None:
    k = 4
    calls, _ = _accum_grad(ctx.group(), k, no_sync_forward=False, divide=True)
    ctx.step("symptom", f"{k} micro-steps with no_sync around backward only")
    ctx.claim("broken_allreduces", calls, "==", k, "gradient all-reduces per optimizer step: {value}")
    ctx.step("diagnosis", "count the all-reduces with a comm hook (common.counters.CommCounter)")
    calls, _ = _accum_grad(ctx.group(), k, no_sync_forward=True, divide=True)
    ctx.step("fix", "with ddp_model.no_sync(): around forward AND backward of the first k-1 micro-steps")
    ctx.claim("fixed_allreduces", calls, "==", 1, "gradient all-reduces per optimizer step: {value}")


@exhibit("loss_not_divided_by_k", "training", min_world=2, lesson="07",
         symptom="with accumulation the training diverges or needs a k times smaller learning rate (no error)",
         cause="the loss of each micro-step is not divided by k: the accumulated gradient is a sum, not a mean")
def loss_not_divided_by_k(ctx: Ctx) -> None:
    k = 4
    _, summed = _accum_grad(ctx.group(), k, no_sync_forward=True, divide=False)
    _, mean = _accum_grad(ctx.group(), k, no_sync_forward=True, divide=True)
    ratio = (summed.norm() / mean.norm()).item()
    ctx.step("symptom", f"{k} micro-steps, loss not divided by k")
    ctx.claim("broken_gradient_ratio", round(ratio, 4), "==", float(k),
              "gradient norm / the mean-loss gradient's norm: {value:g}")
    ctx.step("diagnosis", "compare with the gradient of one step on the whole global batch")
    ctx.step("fix", "loss = loss / k on every micro-step (or weight each micro-batch by its share of samples)")
    ctx.claim("fixed_gradient_ratio", round((mean.norm() / mean.norm()).item(), 4), "==", 1.0,
              "the divided gradient / the global batch's mean gradient: {value:g}")


@exhibit("unscale_twice", "training", lesson="07",
         symptom="RuntimeError: unscale_() has already been called on this optimizer since the last update().",
         cause="GradScaler.unscale_ is called once per micro-step (e.g. to clip inside the accumulation loop)")
def unscale_twice(ctx: Ctx) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def accumulate(k: int, unscale_each: bool) -> None:
        for _ in range(k):
            scaler.scale(model(torch.randn(2, 4)).sum() / k).backward()
            if unscale_each:
                scaler.unscale_(opt)  # to clip: but only once per optimizer step
        if not unscale_each:
            scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    o = ctx.attempt(accumulate, 2, True)
    ctx.step("symptom", f"unscale_ on each of 2 micro-steps: {o.error}")
    ctx.record("symptom", o.error)
    ctx.claim("broken_raises", int("already been called" in (o.error or "")), "==", 1,
              "the second unscale_ raises: {value}")
    ctx.step("diagnosis", "unscale_ divides the gradients by the scale; a second call would divide twice")
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu")
    accumulate(2, False)
    ctx.step("fix", "accumulate k micro-steps, then unscale_ once, clip, scaler.step, scaler.update")
    ctx.claim("fixed_finite", int(all(torch.isfinite(p).all() for p in model.parameters())), "==", 1,
              "the step ran and the parameters are finite: {value}")


@exhibit("nan_spreads_to_all_ranks", "training", min_world=2, lesson="03",
         symptom="loss is nan on every rank, though only one rank's data is bad",
         cause="one rank's NaN gradient enters the all-reduce, which averages it into every rank's gradient")
def nan_spreads_to_all_ranks(ctx: Ctx) -> None:
    def step(guard: bool) -> tuple[DDP, int]:
        torch.manual_seed(0)
        model = DDP(nn.Linear(4, 2), process_group=ctx.group())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.ones(3, 4)
        if ctx.info.rank == 1:
            x[0, 0] = float("nan")  # a corrupt sample on rank 1 only
        loss = model(x).square().mean()
        if guard:
            ok = torch.tensor([float(torch.isfinite(loss))])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=model.process_group)  # every rank decides alike
            if ok.item() == 0:
                return model, 0  # skip backward and step on every rank
        loss.backward()
        opt.step()
        return model, 1
    model, _ = step(guard=False)
    bad = ctx.gather(int(not all(torch.isfinite(p).all() for p in model.parameters())))
    ctx.step("symptom", f"rank 1 has one NaN input; ranks with NaN parameters after one step: {bad}")
    ctx.claim("broken_ranks_with_nan", sum(bad) if bad else 2, "==", 2,
              "ranks whose parameters turned NaN: {value}")
    ctx.step("diagnosis", "check torch.isfinite(loss) per rank before backward: only rank 1's is NaN")
    model, stepped = step(guard=True)
    ctx.step("fix", "all_reduce an isfinite(loss) flag with MIN; skip the step on every rank when it is 0")
    finite = int(all(torch.isfinite(p).all() for p in model.parameters()))
    ctx.claim("fixed_finite", finite, "==", 1, "parameters stay finite on every rank: {value}")
    ctx.claim("fixed_replicas_identical", max_param_diff_across_ranks(model, ctx.info), "==", 0.0,
              "max |parameter difference| across ranks: {value}")
    ctx.record("fixed_stepped", stepped)
