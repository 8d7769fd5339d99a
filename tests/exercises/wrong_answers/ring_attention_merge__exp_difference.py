"""Wrong: the weights from exp(lse_a - lse_b), the difference of the two blocks' lse: finite while the
blocks' lse are within ~709 of each other, inf (then NaN) when one block's scores dwarf the other's."""

import torch


def merge(out_a, lse_a, out_b, lse_b):
    w = torch.exp(lse_a - lse_b).unsqueeze(-1)  # the bug: not bounded by 1
    return (w * out_a + out_b) / (1 + w), lse_b + torch.log1p(torch.exp(lse_a - lse_b))
