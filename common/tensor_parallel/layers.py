"""Tensor parallelism by hand, Megatron-style: the operators f and g, split Linear layers and blocks (lessons 10, 11).

Megatron-LM (Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053, section 3) splits each layer over the tp
ranks of a `tp` group so that one block costs one all-reduce in forward and one in backward:

    x (B, S, H), replicated --f--> column-parallel fc1: rank r holds output features [r*4H/tp, (r+1)*4H/tp)
      --GELU (elementwise: needs no communication)--> row-parallel fc2: rank r holds the same input features
      --g--> y (B, S, H), replicated: the partial products are summed over the tp ranks

    f = `copy_to_tp`:     identity forward, all-reduce backward (each rank sends back a partial input gradient)
    g = `reduce_from_tp`: all-reduce forward, identity backward (its output is replicated: the gradient already is)

Self-attention splits the same way by heads: q, k and v column-parallel (rank r holds heads
[r*nh/tp, (r+1)*nh/tp)), attention per head (no communication), the output projection row-parallel.
The unsplit modules (`MLP`, `SelfAttention`, `Block`) are what the split ones are cut from, and what
`torch.distributed.tensor.parallel.parallelize_module` splits with ColwiseParallel / RowwiseParallel (their
forward infers the local head count from the shape, as torchtitan's attention does).
`common.measure.counters.count_collectives` counts the hand-built ones' collectives (`common.measure.dtensor_counts` DTensor's).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from common.harness.env import LessonError
from common.measure.differences import max_abs_diff, nan_max

__all__ = [
    "copy_to_tp",
    "reduce_from_tp",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "MLP",
    "SelfAttention",
    "Block",
    "TPMLP",
    "TPAttention",
    "digits_transformer",
    "tensor_parallelize",
    "check_tp_degree",
    "max_shard_diff",
]


def _tp_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the partial input gradients of the tp ranks."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # clone: autograd may hand the same gradient tensor to the residual branch; an in-place all-reduce on it
        # would change that branch's gradient too
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward (sum of partial products); identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """f, at the entry of a tensor-parallel region (no-op with no group or a group of one)."""
    return x if _tp_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """g, at the exit of a tensor-parallel region (no-op with no group or a group of one)."""
    return x if _tp_size(group) == 1 else _ReduceFromTP.apply(x, group)


class ColumnParallelLinear(nn.Module):
    """`full` split by output features: rows [r*out/tp, (r+1)*out/tp) of its weight and that slice of its bias.

    x (..., in), the same on every tp rank -> (..., out/tp), this rank's slice of the features. The caller puts
    one `copy_to_tp` before the column-parallel layers that read the same x (q, k and v share one f).
    """

    def __init__(self, full: nn.Linear, tp_rank: int, tp_size: int):
        super().__init__()
        self.weight = nn.Parameter(
            full.weight.detach().chunk(tp_size, 0)[tp_rank].clone()
        )  # (out/tp, in)
        self.bias = nn.Parameter(full.bias.detach().chunk(tp_size, 0)[tp_rank].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """`full` split by input features: columns [r*in/tp, (r+1)*in/tp) of its weight; the bias whole on every rank.

    x (..., in/tp), this rank's slice -> (..., out), summed over the tp ranks by g; the bias is added after the
    sum, so once.
    """

    def __init__(self, full: nn.Linear, tp_rank: int, tp_size: int, group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(
            full.weight.detach().chunk(tp_size, 1)[tp_rank].clone()
        )  # (out, in/tp)
        self.bias = nn.Parameter(full.bias.detach().clone())  # (out,), replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(F.linear(x, self.weight), self.group) + self.bias


class MLP(nn.Module):
    """fc1 (H -> 4H), GELU, fc2 (4H -> H): the transformer's feed-forward block, unsplit."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _attend(q, k, v, head_dim: int) -> torch.Tensor:
    """q, k, v (B, S, nh*hd) -> (B, S, nh*hd); nh is read from the shape, so a rank holding nh/tp heads works."""
    B, S, _ = q.shape
    q, k, v = (t.view(B, S, -1, head_dim).transpose(1, 2) for t in (q, k, v))  # (B, nh, S, hd)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, S, -1)


class SelfAttention(nn.Module):
    """Multi-head self-attention, unsplit: q, k, v (H -> H), heads of hd = H / heads, proj (H -> H)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q, self.k, self.v, self.proj = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(_attend(self.q(x), self.k(x), self.v(x), self.head_dim))


class TPMLP(nn.Module):
    """`MLP` split over the tp group: f, column-parallel fc1, GELU, row-parallel fc2 (g inside)."""

    def __init__(self, full: MLP, tp_rank: int, tp_size: int, group):
        super().__init__()
        self.group = group
        self.fc1 = ColumnParallelLinear(full.fc1, tp_rank, tp_size)
        self.fc2 = RowParallelLinear(full.fc2, tp_rank, tp_size, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, S, H) -> (B, S, 4H/tp) -> (B, S, H)
        return self.fc2(F.gelu(self.fc1(copy_to_tp(x, self.group))))


class TPAttention(nn.Module):
    """`SelfAttention` split by heads: one f, q/k/v column-parallel (nh/tp heads per rank), proj row-parallel."""

    def __init__(self, full: SelfAttention, tp_rank: int, tp_size: int, group):
        super().__init__()
        self.group, self.head_dim = group, full.head_dim
        self.q, self.k, self.v = (
            ColumnParallelLinear(m, tp_rank, tp_size) for m in (full.q, full.k, full.v)
        )
        self.proj = RowParallelLinear(full.proj, tp_rank, tp_size, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.group)  # one f for q, k and v: one all-reduce in backward, not three
        return self.proj(_attend(self.q(x), self.k(x), self.v(x), self.head_dim))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)) (when heads > 0), then x + mlp(norm2(x)); (B, S, H)."""

    def __init__(self, hidden: int, heads: int = 0):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden) if heads else None
        self.attn = SelfAttention(hidden, heads) if heads else None
        self.norm2, self.mlp = nn.LayerNorm(hidden), MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.attn is not None:
            x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _MeanOverSequence(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)  # (B, S, H) -> (B, H)


def digits_transformer(hidden: int, heads: int, layers: int) -> nn.Sequential:
    """A digit image (B, 8, 8) read as a sequence of S=8 rows of 8 pixels: Linear(8 -> H) per row, `layers`
    Blocks, the mean over the rows, Linear(H -> 10). An nn.Sequential, so pipeline stages are slices of it."""
    return nn.Sequential(
        nn.Linear(8, hidden),
        *(Block(hidden, heads) for _ in range(layers)),
        _MeanOverSequence(),
        nn.Linear(hidden, 10),
    )


def tensor_parallelize(model: nn.Module, tp_rank: int, tp_size: int, group) -> nn.Module:
    """A copy of `model` with every MLP and SelfAttention replaced by its hand-built split (rank `tp_rank`'s
    shards); norms, embedding and head stay whole on every tp rank. Parameter names are unchanged."""
    model = copy.deepcopy(model)
    for block in [m for m in model.modules() if isinstance(m, Block)]:
        block.mlp = TPMLP(block.mlp, tp_rank, tp_size, group)
        if block.attn is not None:
            block.attn = TPAttention(block.attn, tp_rank, tp_size, group)
    return model


def check_tp_degree(tp: int, hidden: int, heads: int = 0) -> None:
    """Raise LessonError unless `tp` divides the hidden size (and the head count when there are heads)."""
    if hidden % tp or 4 * hidden % tp:
        raise LessonError(
            f"tensor-parallel degree {tp} does not divide the hidden size {hidden}: each rank "
            f"holds hidden/tp features"
        )
    if heads and (heads % tp or hidden % heads):
        raise LessonError(
            f"tensor-parallel degree {tp} must divide the head count {heads}, and the head count "
            f"the hidden size {hidden}: each rank holds heads/tp whole heads"
        )


def max_shard_diff(full: nn.Module, split: nn.Module, tp_rank: int, grads: bool = False) -> float:
    """Largest |split - full| over parameters of the same name (or their .grad with grads=True): a hand-built
    shard is compared with rank `tp_rank`'s chunk of the full tensor along the dimension where their shapes
    differ; a DTensor (parallelize_module, fully_shard) is gathered whole first (a collective: call on every rank).
    NaN or inf anywhere in either model gives NaN or inf (`common.measure.differences`)."""
    full_params, diffs = dict(full.named_parameters()), []
    for name, p in split.named_parameters():
        mine, ref = (p.grad, full_params[name].grad) if grads else (p, full_params[name])
        mine = mine.full_tensor() if isinstance(mine, DTensor) else mine
        for dim, (a, b) in enumerate(zip(mine.shape, ref.shape)):
            if a != b:
                ref = ref.chunk(b // a, dim)[tp_rank]
        diffs.append(max_abs_diff(mine, ref))
    return nan_max(diffs)
