"""common/inference in one process: the cached attention equals causal SDPA, the cache refuses a write past
its end, the padded-query rule leaves no NaN; the planner's KV-cache bytes and Llama-3-70B's parameters."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from common.inference.kv_cache import KVCache, cached_attention, left_padded, match_heads
from common.planning.cost_model import kv_cache_bytes
from common.planning.serving import LLAMA3_70B, decoder_params, largest_batch, longest_context


def test_cached_attention_over_a_prefix_then_one_token_equals_causal_sdpa():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 4, dtype=torch.float64) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    cache = KVCache(1, 2, 3, 8, 4, dtype=torch.float64)
    keys, values = cache.write(0, 0, k[:, :, :6], v[:, :, :6])
    first = cached_attention(q[:, :, :6], keys, values, 0)
    keys, values = cache.write(0, 6, k[:, :, 6:], v[:, :, 6:])
    last = cached_attention(q[:, :, 6:], keys, values, 6)
    assert torch.allclose(torch.cat([first, last], 2), want, atol=1e-12)
    assert cache.writes == 7 and cache.nbytes() == 2 * 2 * 3 * 8 * 4 * 8
    with pytest.raises(ValueError, match="holds 8 positions"):
        cache.write(0, 7, k[:, :, :2], v[:, :, :2])


def test_a_padded_query_sees_itself_so_no_row_is_nan():
    q, k, v = (torch.randn(1, 1, 4, 2) for _ in range(3))
    valid = torch.tensor([[False, False, True, True]])
    out = cached_attention(q, k, v, 0, valid)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[0, 0, 0], v[0, 0, 0])  # the first pad attends to itself only


def test_kv_cache_bytes_and_llama3_70b():
    assert kv_cache_bytes(2, 4, 8, 32, 2, 4, tp=2) == 16384
    assert kv_cache_bytes(80, 8, 128, 1, 1, 2, tp=16) == kv_cache_bytes(80, 8, 128, 1, 1, 2, tp=8)
    assert abs(decoder_params(LLAMA3_70B) / 70.6e9 - 1) < 0.01  # Meta's model card: 70.6e9
    fit = longest_context(LLAMA3_70B, tp=8, batch=8)
    assert fit["bytes_per_token"] == 8 * 2 * 80 * 1 * 128 * 2
    assert fit["seq"] > 8192


def _filled(heads: int) -> KVCache:
    cache = KVCache(layers=2, batch=2, heads=heads, max_len=6, head_dim=3)
    g = torch.Generator().manual_seed(0)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=g))
    return cache


def test_match_heads_finds_a_ranks_heads_from_the_numbers_and_a_nan_fails():
    whole, part = _filled(4), KVCache(layers=2, batch=2, heads=2, max_len=6, head_dim=3)
    for mine, full in zip(part.k + part.v, whole.k + whole.v):
        mine.copy_(full[:, [3, 1]])
    assert match_heads(part, whole) == ([3, 1], 0.0)
    part.v[1][0, 1, 2, 0] = math.nan
    heads, gap = match_heads(part, whole)
    assert heads[0] == 3 and math.isnan(gap)


def test_largest_batch_fits_and_one_more_does_not():
    fit = largest_batch(LLAMA3_70B, tp=8, seq=8192)
    per_seq = kv_cache_bytes(80, 8, 128, 8192, 1, 2, 8)
    room = fit["usable_gb"] * 1e9 - fit["weights_gb"] * 1e9
    assert fit["batch"] * per_seq <= room < (fit["batch"] + 1) * per_seq
    assert fit["batch"] == 162


def test_left_padded_positions_start_at_each_prompts_first_token():
    tokens, positions, real = left_padded([torch.tensor([5, 6, 7]), torch.tensor([8])])
    assert tokens.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert positions.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert real.tolist() == [[True, True, True], [False, False, True]]
