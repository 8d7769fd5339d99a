"""Lesson 20's model: lessons 19-21's small causal transformer (common/models.py) with a mixture of experts in
its MLP slot, on the digits read as 64 pixel tokens (0-16), predicting the next pixel.

    model = moe_transformer(hidden=32, heads=4, moe=MoE(32, experts=4, k=2))   # one block
    moe_of(model).stats                        # the routing of the last forward
    set_moe(model, ExpertParallelMoE(...))     # the same model with its experts spread over ranks
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.data import PIXEL_VOCAB, digit_sequences
from common.models import CausalTransformer

__all__ = [
    "TokenMoE",
    "moe_transformer",
    "moe_of",
    "set_moe",
    "digit_tokens",
    "next_token_loss",
    "imbalance",
    "EXPERTS",
]

EXPERTS = ".moe.experts."  # in a parameter's name: an expert's (sharded over ep), else replicated


class TokenMoE(nn.Module):
    """The MLP slot (B, S, H) -> (B, S, H) around an MoE that routes rows (N, H): B*S tokens, one batch."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, H = x.shape
        return self.moe(x.reshape(B * S, H)).view(
            B, S, H
        )  # a dropped token: 0, the residual carries it


def moe_transformer(hidden: int, heads: int, moe: nn.Module) -> CausalTransformer:
    """One pre-norm block (attention, then the MoE in the MLP slot) of common.models.CausalTransformer."""
    return CausalTransformer(
        PIXEL_VOCAB, hidden, heads, n_layers=1, mlp_factory=lambda: TokenMoE(moe)
    )


def moe_of(model: CausalTransformer) -> nn.Module:
    """The model's MoE layer (its only block's MLP slot)."""
    return model.blocks[0].mlp.moe


def set_moe(model: CausalTransformer, moe: nn.Module) -> None:
    """Put `moe` in the model's MLP slot (e.g. the ExpertParallelMoE built from the one there)."""
    model.blocks[0].mlp.moe = moe


def digit_tokens(train: bool = True) -> torch.Tensor:
    """The digits as token sequences (N, 64) int64, values 0-16 (common.data.digit_sequences)."""
    return digit_sequences()[0 if train else 1]


def next_token_loss(model: CausalTransformer, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predicting pixel t+1 from pixels 0..t, over a batch (B, 64)."""
    logits = model(tokens[:, :-1])  # (B, 63, 17)
    return F.cross_entropy(logits.reshape(-1, PIXEL_VOCAB), tokens[:, 1:].reshape(-1))


def imbalance(model: CausalTransformer, tokens: torch.Tensor) -> tuple[float, list]:
    """The busiest expert's assignments / the mean, and the histogram, over `tokens` (B, 64) in one forward."""
    with torch.no_grad():
        next_token_loss(model, tokens)
    counts = moe_of(model).stats["counts"]
    return (counts.max() / counts.double().mean()).item(), counts.tolist()
