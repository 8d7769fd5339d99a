"""Grader of exercises/ring_attention_merge.py: two key blocks attended separately and merged, against SDPA
over all the keys (one process)."""
from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F

from exercises.graders._common import max_abs_diff

WORLD_SIZE = 0
FUNCTIONS = ["merge"]
CASES = ((16, 5, 1.0), (16, 8, 1.0), (12, 1, 1.0), (16, 8, 30.0), (16, 8, 180.0))  # keys, keys in A, scale


def _partial(q, k, v):
    """(out, lse) of q's softmax attention over the keys k alone (the exercise's inputs)."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v, lse


def check(module: str) -> list[str]:
    merge = importlib.import_module(module).merge
    for n_keys, split, scale in CASES:
        g = torch.Generator().manual_seed(n_keys + split)
        q = torch.randn(2, 3, 7, 8, generator=g, dtype=torch.float64) * scale  # x180: lse ~800: exp overflows
        k, v = (torch.randn(2, 3, n_keys, 8, generator=g, dtype=torch.float64) for _ in range(2))
        want = F.scaled_dot_product_attention(q, k, v)
        want_lse = torch.logsumexp(q @ k.transpose(-2, -1) / math.sqrt(8), -1)
        a, b = _partial(q, k[:, :, :split], v[:, :, :split]), _partial(q, k[:, :, split:], v[:, :, split:])
        out, lse = merge(*a, *b)
        case = f"{n_keys} keys split {split} + {n_keys - split}, scores x{scale:g}"
        d_out, d_lse = max_abs_diff(out, want), max_abs_diff(lse, want_lse)
        if math.isnan(d_out) or math.isnan(d_lse):
            return [f"{case}: NaN or inf in your result: exp(lse) overflows for large scores; work with "
                    "differences lse_a - lse, which are <= 0"]
        if 1e-9 < max(d_lse, d_out) < 1e-4:
            return [f"{case}: lse off by {d_lse:.2e}, output by {d_out:.2e}: float32's rounding; compute in "
                    "the inputs' dtype (float64 here), do not convert to float32"]
        if d_lse > 1e-9:
            return [f"{case}: lse differs from log-sum-exp over all keys by {d_lse:.2e}: the full "
                    "denominator is exp(lse_a) + exp(lse_b), so lse = logaddexp(lse_a, lse_b)"]
        if d_out > 1e-9:
            averaged = max_abs_diff(out, (a[0] + b[0]) / 2) <= 1e-12
            hint = ("you averaged the two outputs: weight each by its block's share of the softmax, "
                    "exp(lse_a - lse) and exp(lse_b - lse)" if averaged else
                    "weight out_a by exp(lse_a - lse) and out_b by exp(lse_b - lse), lse the merged one")
            return [f"{case}: output differs from attention over all keys by {d_out:.2e}: {hint}"]
    return []
