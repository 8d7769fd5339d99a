"""Lesson 21's tools for the shared GPT (`common.models.CausalTransformer`) at any size: the model in a `GPT`
shape, the FLOPs FlopCounterMode counts in a step, attention written as matmuls (what FLOP formulas count), the saved activations counted from shapes alone (so they work on `meta`),
and an initialisation that gives the same values whether the model was built eagerly or on `meta`.

    with torch.device("meta"):
        big = gpt(GPT(layers=32, hidden=4096, heads=32, vocab=32000, seq=2048))  # 6.7e9 parameters, 0 bytes
    small = CausalTransformer().set_attention(matmul_attention)   # FlopCounterMode then sees Q K^T and A V

Why `matmul_attention`: torch.utils.flop_counter has no formula for the CPU kernel behind
`F.scaled_dot_product_attention` in torch 2.13 (`_scaled_dot_product_flash_attention_for_cpu`), so on CPU the
counter misses the attention's 12 b s^2 h L FLOPs (lesson 21 measures the gap); written out, they are counted.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from common.models import CausalTransformer
from common.planning.cost_model import GPT

__all__ = ["gpt", "counted_flops", "matmul_attention", "init_weights", "saved_bytes_from_shapes"]


def gpt(c: GPT) -> CausalTransformer:
    """The shared GPT of lessons 19-21 (common/models.py) in the shape `c` describes (on `meta` under
    `torch.device("meta")`: shapes, no bytes)."""
    return CausalTransformer(
        vocab=c.vocab, d_model=c.hidden, heads=c.heads, n_layers=c.layers, max_len=c.seq
    )


def counted_flops(model: nn.Module, tokens: torch.Tensor) -> int:
    """FLOPs FlopCounterMode counts in one forward + backward of a next-token loss on `tokens` (B, S)."""
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    return counter.get_total_flops()


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention as two matmuls and a softmax: q, k, v (B, nh, S, hs) -> (B, nh, S, hs). The masked
    half of Q K^T is still computed, as the FLOP formula 2 x 2 b s^2 h per layer forward assumes."""
    S = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, nh, S, S)
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v


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
