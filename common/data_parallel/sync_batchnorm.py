"""SyncBatchNorm built from two all-reduces (introduced in lesson 06; reusable wherever BatchNorm meets DDP).

Under DDP each process runs its own copy of the model, so a plain BatchNorm normalises with the mean and variance
of *this rank's* micro-batch and updates *this rank's* running statistics. `torch.nn.SyncBatchNorm` computes the
statistics over the global batch instead, but in torch 2.13 only on accelerators: its forward accepts cuda, hpu,
xpu and the PrivateUse1 backend, raises on CPU in training once a process group exists (a world of one too), and
DDP refuses a CPU module that holds one. This module computes what it computes, on any device and backend, with
collectives you can read:

    forward, per layer:   ONE all-reduce of [sum_x (C), sum_x2 (C), count (1)]       -> global mean, variance
    backward, per layer:  ONE all-reduce of [sum_dy (C), sum_dy_xhat (C)]             -> global gradient sums

    mean   = sum_x / N                 var = sum_x2 / N - mean^2 (biased: what normalises)
    xhat   = (x - mean) * invstd       invstd = 1 / sqrt(var + eps)
    y      = weight * xhat + bias
    dx     = weight * invstd / N * (N * dy - sum_dy - xhat * sum_dy_xhat)      (sums over the GLOBAL batch)
    dweight = sum over THIS rank of dy * xhat,  dbias = sum over THIS rank of dy
              (local: DDP's gradient all-reduce adds the ranks' shares, as it does for every other parameter)
    running_mean <- (1 - m) * running_mean + m * mean
    running_var  <- (1 - m) * running_var  + m * var * N / (N - 1)          (unbiased, as BatchNorm)

N is the global number of values per channel (batch x H x W summed over the ranks of the process group), so
ranks may hold different batch sizes, one sample or none. The sums travel in float64: E[x^2] - E[x]^2 cancels
badly in float32 when |mean| >> std.

References: Ioffe & Szegedy 2015 (https://arxiv.org/abs/1502.03167);
https://pytorch.org/docs/stable/generated/torch.nn.SyncBatchNorm.html (torch/nn/modules/_functions.py does the
same with an all-gather of per-rank mean/invstd/count in forward and one all-reduce in backward);
https://pytorch.org/docs/stable/notes/extending.html (custom autograd.Function).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from common.harness.compat import batchnorm_has_bias_flag
from common.harness.env import LessonError

__all__ = ["SyncBatchNormFunction", "SyncBatchNorm", "convert_sync_batchnorm", "choose_sync_impl"]

# The BatchNorm flavours and the input ranks they accept (so a converted BatchNorm2d still rejects a 2-D input
# with BatchNorm2d's own message, where nn.SyncBatchNorm accepts any input with at least 2 dimensions).
_EXPECTED_DIMS = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}


def _group_size(process_group) -> int:
    """World size of `process_group` (None: the default group); 1 when no process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


class SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch normalisation over the global batch of a process group.

    forward(x, weight, bias, running_mean, running_var, eps, momentum, process_group) -> y

    Shapes: x (B, C, *) with any B >= 0 on this rank, weight/bias (C,) or None, running stats (C,) or None
    (updated in place when given). `momentum` is the exponential-average factor already resolved by the module
    (1 / num_batches_tracked for momentum=None). Every rank of `process_group` must call it (one all-reduce in
    forward, one in backward, when the group has more than one rank).

    Raises:
        ValueError: the global batch holds one value per channel ("Expected more than 1 value per channel when
            training, ..."), BatchNorm's own message; raised on every rank, after the all-reduce, so none hangs.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_group):
        C = x.size(1)
        dims = [0, *range(2, x.dim())]  # every dimension but the channel one
        local_count = x.numel() // C if C else 0  # values per channel on this rank: B * H * W
        # One buffer, one all-reduce: [sum_x (C) | sum_x2 (C) | count (1)] in float64. The squares too are taken
        # in float64: x^2 rounded to float32 (x ~ 5: error ~1e-6) would swamp a variance of 1e-6.
        x64 = x.detach().double()
        stats = torch.cat(
            [
                x64.sum(dims),
                (x64 * x64).sum(dims),
                torch.full((1,), float(local_count), dtype=torch.float64, device=x.device),
            ]
        )
        world = _group_size(process_group)
        if world > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=process_group)
        sum_x, sum_x2, count = stats[:C], stats[C : 2 * C], stats[2 * C]
        n = int(
            count.item()
        )  # global values per channel (exact: float64 holds integers up to 2**53)
        if n <= 1:
            # Same check and text as F.batch_norm; the size shown is this rank's (BatchNorm sees only its own).
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size {x.size()}"
            )
        mean = sum_x / n
        var = (sum_x2 / n - mean * mean).clamp_min(0.0)  # biased variance: what normalises
        invstd = torch.rsqrt(var + eps)

        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var * (n / (n - 1))  # Bessel's correction with the GLOBAL count
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)

        shape = [1, C] + [1] * (x.dim() - 2)  # broadcast (C,) over (B, C, *)
        mean_b, invstd_b = mean.to(x.dtype).view(shape), invstd.to(x.dtype).view(shape)
        xhat = (x - mean_b) * invstd_b
        y = xhat
        if weight is not None:
            y = y * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        ctx.save_for_backward(x, weight, mean_b, invstd_b)
        ctx.n, ctx.process_group, ctx.world = n, process_group, world
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean_b, invstd_b = ctx.saved_tensors
        C = x.size(1)
        dims = [0, *range(2, x.dim())]
        xhat = (
            x - mean_b
        ) * invstd_b  # recomputed: saving it would keep a second (B, C, *) tensor alive
        sum_dy = dy.sum(dims)  # (C,) this rank's share
        sum_dy_xhat = (dy * xhat).sum(dims)  # (C,)
        grad_weight = (
            sum_dy_xhat.clone() if weight is not None and ctx.needs_input_grad[1] else None
        )
        grad_bias = sum_dy.clone() if ctx.has_bias and ctx.needs_input_grad[2] else None
        dx = None
        if ctx.needs_input_grad[0]:
            # The input gradient needs the two sums over the GLOBAL batch: one all-reduce of (2C,).
            sums = torch.cat([sum_dy, sum_dy_xhat])
            if ctx.world > 1:
                dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=ctx.process_group)
            g_dy, g_dy_xhat = sums[:C], sums[C:]
            shape = mean_b.shape
            scale = invstd_b / ctx.n
            if weight is not None:
                scale = scale * weight.view(shape)
            dx = scale * (ctx.n * dy - g_dy.view(shape) - xhat * g_dy_xhat.view(shape))
        return dx, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of a process group, built from `SyncBatchNormFunction` (any device).

    A drop-in for `nn.SyncBatchNorm` (same constructor, same state_dict keys as BatchNorm: weight, bias,
    running_mean, running_var, num_batches_tracked), usable on CPU with gloo and under DDP.

    - Training mode: statistics of the global batch (one all-reduce in forward, one in backward per layer);
      running mean and unbiased running variance updated as BatchNorm would on the concatenated batch, with
      `momentum` or, for momentum=None, the cumulative average 1 / num_batches_tracked.
    - Eval mode: the running statistics, no communication at all (as nn.SyncBatchNorm).
    - Without a process group (plain `python`) or in a group of one rank it computes what BatchNorm computes.

    Args:
        num_features, eps, momentum, affine, track_running_stats, bias: as `nn.BatchNorm2d`.
        process_group: the ranks to synchronise over (None: the default group, every rank).
        expected_dims: input ranks accepted, e.g. (4,) for a replaced BatchNorm2d; None accepts any >= 2 (as
            nn.SyncBatchNorm does).

    Shapes: input (B, C, *) -> output of the same shape.

    Raises (before any communication, with BatchNorm's messages):
        ValueError: "expected 4D input (got 2D input)" for a wrong input rank.
        RuntimeError: "running_mean should contain 4 elements not 3" for a wrong number of channels.
        ValueError: "Expected more than 1 value per channel when training, ..." for a global batch of one value
            per channel (raised after the forward all-reduce, on every rank).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group=None,
        device=None,
        dtype=None,
        *,
        bias: bool = True,
        expected_dims: tuple[int, ...] | None = None,
    ):
        # `bias=` exists on BatchNorm since torch 2.13; older releases always have a bias (common.harness.compat)
        extra = {"bias": bias} if batchnorm_has_bias_flag() else {}
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device, dtype, **extra
        )
        self.process_group = process_group
        self.expected_dims = expected_dims

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if self.expected_dims is not None and input.dim() not in self.expected_dims:
            want = " or ".join(f"{d}D" for d in self.expected_dims)
            raise ValueError(f"expected {want} input (got {input.dim()}D input)")
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        if input.size(1) != self.num_features:
            raise RuntimeError(
                f"running_mean should contain {input.size(1)} elements not {self.num_features}"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training:
            # Eval: the running statistics (or, without them, this rank's batch); nothing to communicate.
            return nn.functional.batch_norm(
                input,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                self.running_mean is None,
                0.0,
                self.eps,
            )
        factor = 0.0
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = (
                1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            )
        track = self.track_running_stats
        return SyncBatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if track else None,
            self.running_var if track else None,
            self.eps,
            factor,
            self.process_group,
        )


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """Replace every BatchNorm{1,2,3}d in `module` by a from-scratch `SyncBatchNorm` sharing its tensors.

    Like `nn.SyncBatchNorm.convert_sync_batchnorm`: the children of `module` are swapped IN PLACE (the module
    you pass is changed) and the return value is `module`, or a new layer when `module` itself is a BatchNorm.
    Parameters and buffers are the same tensor objects, not copies (an optimizer built earlier still holds the
    right tensors). Call it before the DDP wrap: DDP records the parameters and buffers it finds at wrap time.

    Args:
        process_group: the group each converted layer synchronises over (None: every rank).
    """
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, (SyncBatchNorm, nn.SyncBatchNorm)):
        out = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
            bias=module.bias is not None,
            expected_dims=_EXPECTED_DIMS.get(type(module)),
        )
        if module.weight is not None:
            out.weight = module.weight
        if module.bias is not None:
            out.bias = module.bias
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, process_group))
    return out


def choose_sync_impl(requested: str, device: torch.device) -> str:
    """Which SyncBatchNorm a lesson runs: "torch" (nn.SyncBatchNorm) or "scratch" (this module's).

    `requested` is "auto" (torch on an accelerator, scratch on CPU), "torch" or "scratch". Raises LessonError
    for "torch" on CPU: torch 2.13's nn.SyncBatchNorm forward raises there (it accepts cuda, hpu, xpu and
    PrivateUse1 devices), and DDP refuses the layer on a CPU module."""
    if requested == "auto":
        return "scratch" if device.type == "cpu" else "torch"
    if requested == "torch" and device.type == "cpu":
        raise LessonError(
            "--sync-impl torch: nn.SyncBatchNorm runs on accelerators only in torch 2.13 "
            "(cuda, hpu, xpu, PrivateUse1; its forward raises on CPU); use --sync-impl scratch "
            "or auto"
        )
    return requested
