"""Wrong: the right counts and order, but the counts added up with scatter_add_ into torch.zeros (float32):
[2.0, 1.0] equals [2, 1] in Python, yet no split size or index is a float."""

import torch


def dispatch_plan(expert_of, num_experts, ep):
    dest = expert_of // (num_experts // ep)
    counts = torch.zeros(ep).scatter_add_(0, dest, torch.ones(len(dest)))  # the bug: float32 counts
    return counts, torch.argsort(expert_of, stable=True)
