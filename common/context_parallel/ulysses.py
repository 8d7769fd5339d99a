"""Ulysses attention (lesson 19): context parallelism by switching the split from the sequence to the heads.

Each cp rank holds all H heads of S/cp tokens. One all-to-all (q, k and v stacked) gives each rank H/cp
heads of the whole sequence; it runs ordinary causal attention on them; a second all-to-all puts the output
back to S/cp tokens of all heads. Backward runs the same two all-to-alls the other way (an equal-split
all-to-all is its own inverse: piece i goes to rank i both ways). The constraint it adds: cp must divide
the number of heads.
Source: Jacobs et al. 2023, DeepSpeed-Ulysses (https://arxiv.org/abs/2309.14509).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["ulysses_attention", "check_heads"]


def check_heads(heads: int, cp: int) -> None:
    """Raise ValueError unless cp divides the head count (each rank computes heads/cp whole heads)."""
    if heads % cp:
        raise ValueError(
            f"Ulysses needs the head count {heads} divisible by cp = {cp}: each rank computes "
            f"heads/cp whole heads over the whole sequence"
        )


class _AllToAll(torch.autograd.Function):
    """all_to_all_single on dim 0 (cp equal pieces, piece i to rank i); backward: the same exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # contiguous too: empty_like keeps the strides of what it copies
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()  # autograd may hand a strided gradient
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None
) -> torch.Tensor:
    """Causal attention of this rank's contiguous S/cp tokens q, k, v (B, H, S/cp, D) over the whole sequence
    held by the cp `group`. Returns this rank's output (B, H, S/cp, D)."""
    cp = dist.get_world_size(group) if group is not None else 1
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    B, H, Sl, D = q.shape
    check_heads(H, cp)
    x = torch.stack([q, k, v]).view(3, B, cp, H // cp, Sl, D)  # head group g goes to rank g
    x = _AllToAll.apply(
        x.permute(2, 0, 1, 3, 4, 5).contiguous(), group
    )  # (cp, 3, B, H/cp, Sl, D): piece i
    x = x.permute(1, 2, 3, 0, 4, 5).reshape(
        3, B, H // cp, cp * Sl, D
    )  # came from rank i: tokens chunk i
    y = F.scaled_dot_product_attention(x[0], x[1], x[2], is_causal=True)  # (B, H/cp, S, D)
    y = (
        y.view(B, H // cp, cp, Sl, D).permute(2, 0, 1, 3, 4).contiguous()
    )  # token chunk i goes to rank i
    y = _AllToAll.apply(y, group)  # (cp, B, H/cp, Sl, D): piece g holds head group g
    return y.permute(1, 0, 2, 3, 4).reshape(B, H, Sl, D)
