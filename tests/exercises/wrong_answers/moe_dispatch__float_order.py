"""Wrong: the right order, stored in a torch.zeros buffer (float32): no tensor of floats can index x."""

import torch


def dispatch_plan(expert_of, num_experts, ep):
    order = torch.zeros(len(expert_of))
    order[:] = torch.argsort(expert_of, stable=True)  # the bug: float32 indices
    return torch.bincount(expert_of // (num_experts // ep), minlength=ep), order
