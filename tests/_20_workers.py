"""Worker functions for tests/lessons/test_20_expert_parallel.py (spawned by tests._workers.run_world)."""

from __future__ import annotations

import torch


def unreached_expert_after_momentum(rank: int, world_size: int) -> dict:
    """reduce_grads (common.expert_parallel.training) over a dp group of 2 (ep 1), then SGD with momentum,
    two steps: every parameter gets a gradient at step 1; at step 2 expert 1 gets none on any rank (no token chose it), and
    expert 0 one on rank 0 only. Returns how far each expert's fc1 weight moved at step 2, and its .grad."""
    from common.expert_parallel.model import moe_of, moe_transformer
    from common.expert_parallel.moe import MoE
    from common.expert_parallel.training import reduce_grads
    from common.harness.env import DistInfo
    from common.harness.grid import Grid

    grid = Grid(DistInfo(rank=rank, world_size=world_size, backend="gloo"), dp=world_size, ep=1)
    torch.manual_seed(0)
    model = moe_transformer(8, 2, MoE(8, 4, 2, 1.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    experts = moe_of(model).experts
    for step in (1, 2):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        if step == 2:
            for p in experts[1].parameters():
                p.grad = None
            if rank == 1:
                for p in experts[0].parameters():
                    p.grad = None
        before = [e.fc1.weight.detach().clone() for e in experts[:2]]
        reduce_grads(model, grid)
        opt.step()
    moved = [(e.fc1.weight - b).abs().max().item() for e, b in zip(experts[:2], before)]
    return {"moved": moved, "grad_is_none": [e.fc1.weight.grad is None for e in experts[:2]]}
