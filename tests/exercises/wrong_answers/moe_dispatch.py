"""Wrong: experts dealt to the ranks round-robin (expert e on rank e % ep) instead of in contiguous blocks."""

import torch


def dispatch_plan(expert_of, num_experts, ep):
    dest = expert_of % ep
    return torch.bincount(dest, minlength=ep), torch.argsort(
        dest * num_experts + expert_of, stable=True
    )
