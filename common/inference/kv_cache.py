"""The KV cache (lesson 22): every layer's keys and values of the tokens seen so far, kept so that a
decode step computes q, k, v for the NEW token only and attends to the cached rest.

    cache = KVCache(layers=2, batch=2, heads=4, max_len=64, head_dim=8)  # (B, heads, max_len, hd), 2 L
    k_all, v_all = cache.write(layer, start, k, v)  # k (B, heads, T, hd) stored at [start, start + T)
    y = cached_attention(q, k_all, v_all, start)    # q (B, heads, T, hd): query i sees keys <= start + i

`write` returns views of positions [0, start + T): nothing is copied but the T new rows.

A tensor-parallel rank builds its cache with heads / tp heads (common/inference/tp_decode.py): the bytes
it holds are 2 x layers x (heads / tp) x head_dim x max_len x batch x element size, what
`common.planning.cost_model.kv_cache_bytes` predicts and lesson 22 checks against `nbytes()`.

Attention is written as two matmuls and a softmax (as `common.planning.transformer.matmul_attention`
is), so that torch.utils.flop_counter counts its FLOPs on CPU. Checked against
F.scaled_dot_product_attention (tests/unit/test_inference.py) and, by lesson 22, against the model
rerun on the whole prefix at every step.
"""

from __future__ import annotations

import math

import torch

__all__ = ["KVCache", "cached_attention"]


class KVCache:
    """Preallocated keys and values, one pair of (B, heads, max_len, head_dim) tensors per layer.

    Raises:
        ValueError: a write past `max_len`.
    """

    def __init__(
        self, layers: int, batch: int, heads: int, max_len: int, head_dim: int, dtype=torch.float32
    ):
        shape = (batch, heads, max_len, head_dim)
        self.max_len = max_len
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.writes = (
            0  # tokens written, summed over layers and calls (a recomputed cache shows here)
        )

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v (B, heads, T, hd) at positions [start, start + T) of `layer`; return the keys and values
        of positions [0, start + T), views of the cache (nothing is copied but the T new rows)."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; writing up to {end}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        self.writes += k.shape[2]
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def nbytes(self) -> int:
        """Bytes this process holds for the cache, counted from its tensors."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of T new queries over every cached key: q (B, h, T, hd), k and v (B, h, start + T, hd)
    -> (B, h, T, hd). Query i sits at position start + i and sees keys 0 .. start + i; `valid` (B, start + T)
    bool, if given, also hides padded keys (a left-padded batch) from every query but their own. A masked
    key gets exactly 0 weight."""
    T, S = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, h, T, S)
    query_pos = torch.arange(start, start + T).unsqueeze(1)  # (T, 1)
    keep = torch.arange(S).unsqueeze(0) <= query_pos  # (T, S): causal
    if valid is not None:
        # a padded query still sees itself, so no row is all -inf (a NaN row, then 0 x NaN in A V)
        own = torch.arange(S).unsqueeze(0) == query_pos  # (T, S)
        keep = keep & (valid[:, None, None, :S] | own)  # (B, 1, T, S)
    return scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v
