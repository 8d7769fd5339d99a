"""Wrong: the sorted experts returned as the order (torch.sort's values, not argsort's indices)."""

import torch


def dispatch_plan(expert_of, num_experts, ep):
    counts = torch.bincount(expert_of // (num_experts // ep), minlength=ep)
    return counts, torch.sort(expert_of, stable=True).values  # the bug: values, not a permutation
