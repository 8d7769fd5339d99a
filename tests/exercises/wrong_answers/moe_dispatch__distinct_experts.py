"""Wrong: send_counts counts the distinct experts each rank gets rows for, not the rows."""

import torch


def dispatch_plan(expert_of, num_experts, ep):
    experts = torch.unique(expert_of)  # the bug: an expert with 5 rows counts once
    return torch.bincount(experts // (num_experts // ep), minlength=ep), torch.argsort(
        expert_of, stable=True
    )
