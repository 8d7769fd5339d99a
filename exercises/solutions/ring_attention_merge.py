"""Reference solution of exercises/ring_attention_merge.py (lesson 19; common/context_parallel/ring_attention.py's merge)."""

import torch


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    lse = torch.logaddexp(lse_a, lse_b)  # log(exp(lse_a) + exp(lse_b)), the full denominator
    # each block's share of the full denominator: exp(lse_a) / exp(lse) <= 1, computed without overflow
    out = (
        torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
    )
    return out, lse
