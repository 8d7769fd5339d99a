"""Grader of exercises/ring_attention_merge.py: two key blocks attended separately and merged, against SDPA
over all the keys (one process)."""

from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F

from exercises.graders._common import answer_diff

WORLD_SIZE = 0
FUNCTIONS = ["merge"]
# (keys, keys in A, how the scores are made): x scale, or "A >> B" / "B >> A": one block's keys along the
# queries (scores ~ +400), the other's against them (~ -400): each lse below 709, their difference ~ 800.
CASES = (
    (16, 5, 1.0),
    (16, 8, 1.0),
    (12, 1, 1.0),
    (16, 8, 30.0),
    (16, 8, 180.0),
    (16, 8, "A >> B"),
    (16, 8, "B >> A"),
)
EXP_LIMIT = 709.78  # log of float64's largest number: exp() of more is inf


def _partial(q, k, v):
    """(out, lse) of q's softmax attention over the keys k alone (the exercise's inputs)."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v, lse


def inputs(n_keys: int, split: int, scores) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (2, 3, 7, 8), k and v (2, 3, n_keys, 8), float64."""
    g = torch.Generator().manual_seed(n_keys + split)
    if not isinstance(scores, str):
        q = torch.randn(2, 3, 7, 8, generator=g, dtype=torch.float64) * scores  # x180: lse ~800
        k, v = (torch.randn(2, 3, n_keys, 8, generator=g, dtype=torch.float64) for _ in range(2))
        return q, k, v
    u = torch.randn(8, generator=g, dtype=torch.float64)
    u /= u.norm()  # every query along u: q . k / sqrt(8) = 20 x 57 / 2.83 ~ 403 for a key along u
    q = 20 * u + 0.1 * torch.randn(2, 3, 7, 8, generator=g, dtype=torch.float64)
    sign = torch.ones(n_keys, 1, dtype=torch.float64)
    sign[split:] = -1.0
    if scores == "B >> A":
        sign = -sign
    k = sign * 57 * u + 0.1 * torch.randn(2, 3, n_keys, 8, generator=g, dtype=torch.float64)
    return q, k, torch.randn(2, 3, n_keys, 8, generator=g, dtype=torch.float64)


def _overflow(case: str, lse_a: torch.Tensor, lse_b: torch.Tensor) -> str:
    """Why a merge made NaN or inf here: which exponent passes float64's limit."""
    largest, apart = (
        max(lse_a.abs().max(), lse_b.abs().max()).item(),
        (lse_a - lse_b).abs().max().item(),
    )
    if largest < EXP_LIMIT < apart:
        return (
            f"{case}: NaN or inf in your result: each |lse| is at most {largest:.0f}, but the blocks' "
            f"lse differ by up to {apart:.0f}, and exp of that difference (lse_a - lse_b or "
            "lse_b - lse_a) overflows past ~709: exponentiate only differences with the merged lse, "
            "lse_a - lse and lse_b - lse, which are <= 0"
        )
    return (
        f"{case}: NaN or inf in your result: exp(lse) overflows for large scores (lse up to "
        f"{largest:.0f} here, exp overflows past ~709); work with differences lse_a - lse, "
        "which are <= 0"
    )


def check(module: str) -> list[str]:
    merge = importlib.import_module(module).merge
    for n_keys, split, scores in CASES:
        q, k, v = inputs(n_keys, split, scores)
        want = F.scaled_dot_product_attention(q, k, v)
        want_lse = torch.logsumexp(q @ k.transpose(-2, -1) / math.sqrt(8), -1)
        a, b = (
            _partial(q, k[:, :, :split], v[:, :, :split]),
            _partial(q, k[:, :, split:], v[:, :, split:]),
        )
        out, lse = merge(*a, *b)
        how = scores if isinstance(scores, str) else f"x{scores:g}"
        case = f"{n_keys} keys split {split} + {n_keys - split}, scores {how}"
        d_out, d_lse = answer_diff(out, want), answer_diff(lse, want_lse)
        if math.isnan(d_out) or math.isnan(d_lse):
            return [_overflow(case, a[1], b[1])]
        if 1e-9 < max(d_lse, d_out) < 1e-4:
            return [
                f"{case}: lse off by {d_lse:.2e}, output by {d_out:.2e}: float32's rounding; compute in "
                "the inputs' dtype (float64 here), do not convert to float32"
            ]
        if d_lse > 1e-9:
            return [
                f"{case}: lse differs from log-sum-exp over all keys by {d_lse:.2e}: the full "
                "denominator is exp(lse_a) + exp(lse_b), so lse = logaddexp(lse_a, lse_b)"
            ]
        if d_out > 1e-9:
            averaged = answer_diff(out, (a[0] + b[0]) / 2) <= 1e-12
            hint = (
                "you averaged the two outputs: weight each by its block's share of the softmax, "
                "exp(lse_a - lse) and exp(lse_b - lse)"
                if averaged
                else "weight out_a by exp(lse_a - lse) and out_b by exp(lse_b - lse), lse the merged one"
            )
            return [f"{case}: output differs from attention over all keys by {d_out:.2e}: {hint}"]
    return []
