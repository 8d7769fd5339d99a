"""Lesson 12's exhibits of gradient mistakes: accumulation under DDP, GradScaler, a NaN on one rank.

The NaN-gradient exhibits live in `common.exhibits.nan`.

DDP runs on a fresh gloo group per version (`Ctx.group`); see `common.exhibits.frame` for the frame.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.exhibits.frame import Ctx, exhibit
from common.measure.counters import CommCounter


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
            with (
                model.no_sync()
            ):  # only the backward inside: DDP still all-reduces (the forward armed it)
                loss.backward()
        else:
            loss.backward()
    return counter.calls, model.module.weight.grad.clone()


@exhibit(
    "no_sync_around_backward_only",
    "training",
    min_world=2,
    lesson="07",
    symptom="",
    cause="no_sync() wraps loss.backward() only; the forward outside it already armed the all-reduce",
    when=(
        "no error: gradient accumulation is as slow as no accumulation, one all-reduce "
        "per micro-step"
    ),
    fix=("with ddp_model.no_sync(): around forward AND backward of the first k-1 micro-steps"),
)
def no_sync_around_backward_only(ctx: Ctx) -> None:
    k = 4
    calls, _ = _accum_grad(ctx.group(), k, no_sync_forward=False, divide=True)
    ctx.step("symptom", f"{k} micro-steps with no_sync around backward only")
    ctx.claim(
        "broken_allreduces", calls, "==", k, "gradient all-reduces per optimizer step: {value}"
    )
    ctx.step(
        "diagnosis", "count the all-reduces with a comm hook (common.measure.counters.CommCounter)"
    )
    calls, _ = _accum_grad(ctx.group(), k, no_sync_forward=True, divide=True)
    ctx.step(
        "fix", "with ddp_model.no_sync(): around forward AND backward of the first k-1 micro-steps"
    )
    ctx.claim(
        "fixed_allreduces", calls, "==", 1, "gradient all-reduces per optimizer step: {value}"
    )


def _global_batch_grad(k: int, world: int) -> torch.Tensor:
    """The gradient of one step on the global batch: every rank's k micro-batches in one mean-reduced loss."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)  # the same start as `_accum_grad`
    xs = []
    for rank in range(world):  # the micro-batches each rank draws in `_accum_grad`, in its order
        gen = torch.Generator().manual_seed(10 + rank)
        xs += [torch.randn(2, 4, generator=gen) for _ in range(k)]
    model(
        torch.cat(xs)
    ).square().mean().backward()  # (world * k * 2, 4): one mean over every sample
    return model.weight.grad.clone()


@exhibit(
    "loss_not_divided_by_k",
    "training",
    min_world=2,
    lesson="07",
    symptom="",
    cause="the loss of each micro-step is not divided by "
    "k: the accumulated gradient is a sum, not a mean",
    when=(
        "no error: with accumulation the training diverges or needs a k times smaller learning rate"
    ),
    fix="loss = loss / k on every micro-step",
)
def loss_not_divided_by_k(ctx: Ctx) -> None:
    k = 4
    _, summed = _accum_grad(ctx.group(), k, no_sync_forward=True, divide=False)
    reference = _global_batch_grad(k, ctx.info.world_size)
    ctx.step("symptom", f"{k} micro-steps, loss not divided by k")
    ctx.claim(
        "broken_gradient_ratio",
        round((summed.norm() / reference.norm()).item(), 4),
        "==",
        float(k),
        "|accumulated gradient| / |gradient of one step on the global batch|: {value:g}",
    )
    ctx.step(
        "diagnosis",
        f"compare with one step on the global batch (all {ctx.info.world_size} ranks' {k} "
        "micro-batches in one loss, computed here in each process)",
    )
    _, mean = _accum_grad(ctx.group(), k, no_sync_forward=True, divide=True)
    ctx.step(
        "fix",
        "loss = loss / k on every micro-step (or weight each micro-batch by its share of samples)",
    )
    ctx.claim(
        "fixed_gradient_diff",
        (mean - reference).abs().max().item(),
        "<=",
        1e-6,
        "max |divided gradient - the global batch's gradient|: {value:.1e}",
    )


@exhibit(
    "unscale_twice",
    "training",
    lesson="07",
    symptom="RuntimeError: unscale_() has already been called "
    "on this optimizer since the last update().",
    cause="GradScaler.unscale_ is called once per micro-step "
    "(e.g. to clip inside the accumulation loop)",
    fix="accumulate k micro-steps, then unscale_ once, clip, scaler.step, scaler.update",
)
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
    ctx.claim(
        "broken_raises",
        int("already been called" in (o.error or "")),
        "==",
        1,
        "the second unscale_ raises: {value}",
    )
    ctx.step(
        "diagnosis", "unscale_ divides the gradients by the scale; a second call would divide twice"
    )
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu")
    accumulate(2, False)
    ctx.step(
        "fix", "accumulate k micro-steps, then unscale_ once, clip, scaler.step, scaler.update"
    )
    ctx.claim(
        "fixed_finite",
        int(all(torch.isfinite(p).all() for p in model.parameters())),
        "==",
        1,
        "the step ran and the parameters are finite: {value}",
    )
