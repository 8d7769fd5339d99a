"""A GPT-style decoder built from a `common.planning.GPT` config (lesson 18): small enough to run on a CPU at
toy sizes, and buildable at billions of parameters on the `meta` device, where it allocates nothing.

    model = GPTModel(GPT(layers=2, hidden=32, heads=4, vocab=17, seq=16))      # tokens (B, s) -> logits (B, s, V)
    with torch.device("meta"):
        big = GPTModel(GPT(layers=32, hidden=4096, heads=32, vocab=32000, seq=4096))   # 6.8e9 parameters, 0 bytes

Attention is written out (Q K^T, softmax, A V) so that its matmuls are the ones `gpt_flops` counts, with a causal
mask (the masked half is still computed, as the FLOP formula assumes). No dropout (Korthikanti's formula counts
dropout masks; this model is for parameter and FLOP counts).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.planning import GPT

__all__ = ["GPTModel", "Block", "init_weights", "saved_bytes_from_shapes"]


class Block(nn.Module):
    def __init__(self, c: GPT):
        super().__init__()
        self.heads = c.heads
        self.ln1, self.ln2 = nn.LayerNorm(c.hidden), nn.LayerNorm(c.hidden)
        self.qkv = nn.Linear(c.hidden, 3 * c.hidden)
        self.proj = nn.Linear(c.hidden, c.hidden)
        self.fc = nn.Linear(c.hidden, 4 * c.hidden)
        self.fc2 = nn.Linear(4 * c.hidden, c.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)  # (B, s, h) each
        q, k, v = (t.reshape(B, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, a, s, d)
        scores = q @ k.transpose(-2, -1) / math.sqrt(h // self.heads)  # (B, a, s, s)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, s, h)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPTModel(nn.Module):
    def __init__(self, c: GPT):
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.hidden)
        self.pos = nn.Embedding(c.seq, c.hidden)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)  # (B, s, h)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, s, V)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Deterministic initialisation from `seed` alone, in module order: the same values whether the model was
    built eagerly or on `meta` and then materialised with `to_empty` (which leaves memory uninitialised)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        elif "ln" in name and name.endswith("weight"):
            p.fill_(1.0)
        else:
            p.zero_()


def saved_bytes_from_shapes(model, run) -> int:
    """Bytes autograd saves for backward during `run()`, counted from shapes alone (so it works on `meta`):
    each saved tensor's root (a view's base) once, parameters and views of them excluded."""
    params = {id(p) for p in model.parameters()}
    roots = {}

    def pack(t):
        root = t if t._base is None else t._base
        if id(root) not in params:
            roots[id(root)] = root  # keeps it alive, so that no other tensor reuses its id
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(r.numel() * r.element_size() for r in roots.values())
