"""Wrong: the rows sorted by destination rank only: within a rank its experts' rows are interleaved."""

import torch


def dispatch_plan(expert_of, num_experts, ep):
    dest = expert_of // (num_experts // ep)
    return torch.bincount(dest, minlength=ep), torch.argsort(
        dest, stable=True
    )  # the bug: not by expert
