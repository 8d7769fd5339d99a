"""Wrong: sorted by expert with the ties broken the wrong way (the later row first): rows of one expert do
not keep their token order."""

import torch


def dispatch_plan(expert_of, num_experts, ep):
    m = len(expert_of)
    key = expert_of * max(m, 1) + (m - 1 - torch.arange(m))  # the bug: a descending tiebreak
    return torch.bincount(expert_of // (num_experts // ep), minlength=ep), torch.argsort(key)
