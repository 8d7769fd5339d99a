"""common/inference in one process: the cached attention equals causal SDPA, the cache refuses a write past
its end, the padded-query rule leaves no NaN; the planner's KV-cache bytes and Llama-3-70B's parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.inference.kv_cache import KVCache, cached_attention
from common.planning.cost_model import kv_cache_bytes
from common.planning.serving import LLAMA3_70B, decoder_params, longest_context


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
