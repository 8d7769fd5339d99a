"""Training with context parallelism (lesson 19): every cp rank holds S/cp tokens of the same sequences.

    loss_sum, total, n = token_loss(model, x, positions, group)   # this rank's sum; the global (sum, count)
    (loss_sum / n).backward()                                     # this rank's share of the mean over tokens
    sum_grads(model, group)                                       # the shares summed over the cp ranks

The mean over all tokens is sum / count with both summed over the cp ranks: the ranks hold different numbers of
targets (the last token of a sequence has none), so a mean of per-rank means would be wrong. Each rank's tokens
gave part of every parameter's gradient, so the gradients are summed (not averaged) over the cp group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.data import next_token_targets

__all__ = ["TrainedPair", "token_loss", "held_out_loss", "sum_grads", "one_process_step"]


@dataclass
class TrainedPair:
    """Two models trained on the same batches, one in one process and its copy with context
    parallelism, with what their checks need: this rank's token positions, the held-out sequences,
    the cp model's held-out loss before training and the losses per step ("one_process", "cp")."""

    full: torch.nn.Module
    model: torch.nn.Module
    positions: torch.Tensor
    test_tokens: torch.Tensor
    test_before: float
    losses: dict


def token_loss(
    model, x: torch.Tensor, positions: torch.Tensor, group
) -> tuple[torch.Tensor, float, int]:
    """This rank's summed next-pixel loss over its tokens of x (B, 64), and the global (sum, count) over cp."""
    y = next_token_targets(x)[:, positions]  # (B, S/cp): the targets of this rank's tokens
    logits = model(x[:, positions], positions)  # (B, S/cp, vocab)
    loss_sum = F.cross_entropy(
        logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum"
    )
    totals = torch.tensor(
        [loss_sum.item(), (y != -100).sum().item()], dtype=torch.float64, device=x.device
    )
    if group is not None:
        dist.all_reduce(totals, group=group)
    return loss_sum, totals[0].item(), int(totals[1].item())


@torch.no_grad()
def held_out_loss(model, x: torch.Tensor, positions: torch.Tensor, group) -> float:
    """The mean next-pixel loss over every token of x (B, 64), this rank holding `positions` of each."""
    _, total, n = token_loss(model, x, positions, group)
    return total / n


def one_process_step(model, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    """The reference: one SGD step of `model` on whole sequences x (B, 64), the mean over their targets."""
    logits = model(x).flatten(0, 1)
    loss = F.cross_entropy(logits, next_token_targets(x).flatten(), ignore_index=-100)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def sum_grads(model: torch.nn.Module, group) -> None:
    """Sum every parameter's gradient over the cp `group` (None: one process, nothing to sum)."""
    if group is None:
        return
    for p in model.parameters():
        dist.all_reduce(p.grad, group=group)
