"""Wrong: send_counts counted per expert, not per destination rank."""

import torch


def dispatch_plan(expert_of, num_experts, ep):
    return torch.bincount(expert_of, minlength=num_experts), torch.argsort(expert_of, stable=True)
