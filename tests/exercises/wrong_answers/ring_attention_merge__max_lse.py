"""Wrong: the right output, but the lse returned is the larger block's ("the larger one dominates"): the
next merge of the ring then weighs this pair too little."""

import torch


def merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    out = (
        torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
    )
    return out, torch.maximum(lse_a, lse_b)  # the bug
