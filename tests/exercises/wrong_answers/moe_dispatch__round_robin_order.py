"""Wrong: the right counts, but the rows ordered by (e % ep, e), the round-robin placement: with ep > 1 the
ranks' rows are interleaved instead of grouped."""

import torch


def dispatch_plan(expert_of, num_experts, ep):
    counts = torch.bincount(expert_of // (num_experts // ep), minlength=ep)
    key = (expert_of % ep) * num_experts + expert_of  # the bug: the order of another placement
    return counts, torch.argsort(key, stable=True)
