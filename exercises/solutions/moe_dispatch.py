"""Reference solution of exercises/moe_dispatch.py (lesson 20); common.expert_parallel.moe.dispatch_plan does the same with a
capacity mask."""

import torch


def dispatch_plan(
    expert_of: torch.Tensor, num_experts: int, ep: int
) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.argsort(expert_of, stable=True)  # by expert, hence by rank; ties keep token order
    send_counts = torch.bincount(
        expert_of // (num_experts // ep), minlength=ep
    )  # rank d: a block of E/ep
    return send_counts, order
