"""Lesson 12's exhibits of NaN: one rank's NaN reaches every rank; a finite loss with a NaN gradient.

DDP runs on a fresh gloo group per version (`Ctx.group`); see `common.exhibits.frame` for the frame.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.exhibits.frame import Ctx, exhibit
from common.harness.ranks import max_param_diff_across_ranks


@exhibit(
    "nan_spreads_to_all_ranks",
    "training",
    min_world=2,
    lesson="03",
    symptom="",
    cause="one rank's NaN gradient enters the all-reduce, which averages it into every rank's gradient",
    when="no error: loss is nan on every rank, though only one rank's data is bad",
    fix=("all_reduce an isfinite(loss) flag with MIN; skip the step on every rank when it is 0"),
)
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
            dist.all_reduce(
                ok, op=dist.ReduceOp.MIN, group=model.process_group
            )  # every rank decides alike
            if ok.item() == 0:
                return model, 0  # skip backward and step on every rank
        loss.backward()
        opt.step()
        return model, 1

    model, _ = step(guard=False)
    bad = ctx.gather(int(not all(torch.isfinite(p).all() for p in model.parameters())))
    ctx.step(
        "symptom", f"rank 1 has one NaN input; ranks with NaN parameters after one step: {bad}"
    )
    ctx.claim(
        "broken_ranks_with_nan",
        sum(bad),
        "==",
        ctx.info.world_size if bad else 0,
        "ranks whose parameters turned NaN: {value}",
    )
    ctx.step(
        "diagnosis", "check torch.isfinite(loss) per rank before backward: only rank 1's is NaN"
    )
    model, stepped = step(guard=True)
    ctx.step(
        "fix",
        "all_reduce an isfinite(loss) flag with MIN; skip the step on every rank when it is 0",
    )
    finite = int(all(torch.isfinite(p).all() for p in model.parameters()))
    ctx.claim("fixed_finite", finite, "==", 1, "parameters stay finite on every rank: {value}")
    ctx.claim(
        "fixed_replicas_identical",
        max_param_diff_across_ranks(model, ctx.info),
        "==",
        0.0,
        "max |parameter difference| across ranks: {value}",
    )
    ctx.record("fixed_stepped", stepped)


def _masked_sqrt_model(ctx: Ctx) -> tuple[nn.Module, nn.Module]:
    """(model to train, its unwrapped module): Linear(4, 1), weight 0.1 and bias 1: y(ones) = 1.4 > 0."""
    net = nn.Linear(4, 1)
    with torch.no_grad():
        net.weight.fill_(0.1)
        net.bias.fill_(1.0)
    return (DDP(net, process_group=ctx.group()) if ctx.info.distributed else net), net


def _masked_sqrt_loss(model: nn.Module, bad: bool) -> torch.Tensor:
    x = torch.ones(3, 4)
    if bad:
        x[0] = -100.0  # one outlier sample on the last rank: y = -39
    y = model(x).squeeze(1)
    return torch.where(
        y > 0, y.sqrt(), torch.zeros_like(y)
    ).mean()  # the mask hides sqrt(-39) = NaN ...


def _masked_sqrt_step(ctx: Ctx, guard: bool) -> dict:
    """One SGD step; guard=True checks the gradient norm before optimizer.step(), skips a non-finite one."""
    model, net = _masked_sqrt_model(ctx)
    before = [p.detach().clone() for p in net.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = _masked_sqrt_loss(model, ctx.info.rank == ctx.info.world_size - 1)
    loss.backward()  # ... but not from the gradient: 0 * d sqrt(y)/dy = 0 * NaN = NaN (DDP averages it in)
    stepped = 1
    if guard:
        norm = nn.utils.clip_grad_norm_(
            model.parameters(), max_norm=1.0
        )  # the norm before clipping
        if not torch.isfinite(
            norm
        ):  # after DDP's all-reduce every rank holds the same norm: same decision
            opt.zero_grad()
            stepped = 0
    if stepped:
        opt.step()
    moved = torch.stack(
        [(p.detach() - b).abs().max() for p, b in zip(net.parameters(), before)]
    ).max()
    return {
        "loss_finite": int(torch.isfinite(loss)),
        "nan": int(not all(torch.isfinite(p).all() for p in net.parameters())),
        "stepped": stepped,
        "moved": moved.item(),
        "model": model,
    }


def _anomaly(ctx: Ctx) -> str:
    """What torch.autograd.detect_anomaly says about this rank's backward ('' when it finds nothing)."""
    net = _masked_sqrt_model(ctx)[1]  # the unwrapped module: no collective in this check
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it also warns with the forward's traceback
        bad = ctx.info.rank == ctx.info.world_size - 1
        with torch.autograd.detect_anomaly():
            o = ctx.attempt(lambda: _masked_sqrt_loss(net, bad).backward())
    return o.error or ""


@exhibit(
    "nan_gradient_with_finite_loss",
    "training",
    lesson="03",
    symptom="",
    cause="a masked op (torch.where around sqrt, or log at 0) hides "
    "a NaN from the loss, not from the gradient: 0 * NaN = NaN",
    when=(
        "no error: parameters turn nan after optimizer.step() though every loss was "
        "finite (a check of the loss passes)"
    ),
    fix="skip the step when not torch.isfinite(norm)",
)
def nan_gradient_with_finite_loss(ctx: Ctx) -> None:
    world = ctx.info.world_size
    broken = _masked_sqrt_step(ctx, guard=False)
    facts = ctx.gather({k: v for k, v in broken.items() if k != "model"})
    ctx.step(
        "symptom",
        f"loss = where(y > 0, sqrt(y), 0).mean(); one outlier on rank {world - 1}; one step:",
    )
    ctx.claim(
        "broken_loss_finite",
        sum(f["loss_finite"] for f in facts),
        "==",
        world if facts else 0,
        "ranks whose loss is finite (a torch.isfinite(loss) check passes): {value}",
    )
    ctx.claim(
        "broken_ranks_with_nan",
        sum(f["nan"] for f in facts),
        "==",
        world if facts else 0,
        "ranks whose parameters turned NaN: {value}",
    )
    errors = ctx.gather(_anomaly(ctx))
    ctx.step(
        "diagnosis",
        "torch.autograd.detect_anomaly() (slow: debugging only) names the backward op that "
        f"made the NaN: {next((e for e in errors if e), '')}",
    )
    ctx.record("diagnosis", errors)
    ctx.claim(
        "anomaly_names_sqrt",
        sum("SqrtBackward0" in e for e in errors),
        "==",
        1 if errors else 0,
        "ranks where detect_anomaly names SqrtBackward0 (the outlier's): {value}",
    )
    fixed = _masked_sqrt_step(ctx, guard=True)
    facts = ctx.gather({k: v for k, v in fixed.items() if k != "model"})
    ctx.step(
        "fix",
        "norm = clip_grad_norm_(...) before optimizer.step(); skip the step when "
        "not torch.isfinite(norm) (or pass error_if_nonfinite=True); better: sqrt(clamp(y, min=eps))",
    )
    ctx.claim(
        "fixed_skipped",
        sum(1 - f["stepped"] for f in facts),
        "==",
        world if facts else 0,
        "ranks that skipped the step: {value}",
    )
    moved = torch.tensor([f["moved"] for f in facts] or [0.0]).max().item()  # NaN stays NaN
    ctx.claim(
        "fixed_params_unchanged", moved, "==", 0.0, "max |parameter change| over the ranks: {value}"
    )
