"""A tiny causal transformer whose MLP is a mixture of experts, on the digits read as 64 pixel tokens (0-16).

Lesson 17's model until the shared transformer of lessons 16-18 (common/models.py) lands: embeddings, one block
(LayerNorm -> causal self-attention -> LayerNorm -> MoE, each with its residual) and a head that predicts the
next pixel's value. `moe` is the slot: an `common.moe.MoE` or its `ExpertParallelMoE`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.data import digits_split

__all__ = ["MoETransformer", "digit_tokens", "next_token_loss", "VOCAB", "SEQ"]

VOCAB = 17  # pixel values 0 .. 16
SEQ = 64    # an 8 x 8 digit, row by row


def digit_tokens(train: bool = True) -> torch.Tensor:
    """The digits as token sequences (N, 64) int64, values 0-16 (the data's original integer levels)."""
    images = digits_split()[0 if train else 1].tensors[0]  # (N, 1, 8, 8) in [0, 1]
    return (images.flatten(1) * 16).round().long()


class MoETransformer(nn.Module):
    """tokens (B, T) -> logits (B, T, 17). The MoE sees the B*T tokens as one batch of rows (N, H)."""

    def __init__(self, hidden: int, heads: int, moe: nn.Module):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, hidden), nn.Embedding(SEQ, hidden)
        self.norm1, self.norm2, self.norm_f = nn.LayerNorm(hidden), nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.moe = moe
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape
        x = self.tok(tokens) + self.pos(torch.arange(T, device=tokens.device))  # (B, T, H)
        h = self.norm1(x)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)   # True: may not look
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        x = x + self.moe(self.norm2(x).reshape(B * T, -1)).view(B, T, -1)     # dropped token: x + 0
        return self.head(self.norm_f(x))


def next_token_loss(model: MoETransformer, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predicting pixel t+1 from pixels 0..t, over a batch (B, 64)."""
    logits = model(tokens[:, :-1])  # (B, 63, 17)
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
