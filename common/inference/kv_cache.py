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

from common.measure.differences import max_abs_diff_all

__all__ = ["KVCache", "cached_attention", "left_padded", "match_heads"]


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


def match_heads(part: KVCache, whole: KVCache) -> tuple[list[int], float]:
    """Which heads of `whole` (one process's filled cache) each head of `part` (a tp rank's filled cache)
    holds, found from the numbers: local head j is the global head whose keys and values, over every
    layer, differ least from it. Returns those heads and max |part - whole[:, heads]| (NaN if either
    cache holds a NaN or an inf)."""
    pairs = list(zip(part.k + part.v, whole.k + whole.v))  # (B, h, max_len, hd) each
    heads = []
    for j in range(part.k[0].shape[1]):
        gaps = [
            max_abs_diff_all([p[:, j] for p, _ in pairs], [w[:, h] for _, w in pairs])
            for h in range(whole.k[0].shape[1])
        ]
        finite = [math.inf if math.isnan(g) else g for g in gaps]  # a NaN head matches nothing
        heads.append(finite.index(min(finite)))
    return heads, max_abs_diff_all([p for p, _ in pairs], [w[:, heads] for _, w in pairs])


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts of different lengths left-padded to the longest: tokens (B, P), positions (B, P)
    counted from each prompt's first real token, and the real-token mask (B, P)."""
    P = max(len(p) for p in prompts)
    pads = torch.tensor([P - len(p) for p in prompts])[:, None]  # (B, 1)
    tokens = torch.stack(
        [torch.cat([torch.zeros(P - len(p), dtype=torch.long), p]) for p in prompts]
    )
    positions = (torch.arange(P) - pads).clamp(min=0)
    return tokens, positions, torch.arange(P) >= pads
