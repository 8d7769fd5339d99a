"""Worker functions for tests/unit/test_zero.py (spawned by tests._workers.run_world; importable so that `spawn`
can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def stages_vs_one_process(rank: int, world_size: int, width: int = 5, steps: int = 3) -> dict:
    """Each ZeRO stage over this world against one process training on the whole global batch (computed here on
    every rank, no communication): the largest parameter difference, the collectives of one step, what the rank
    holds at the end of backward and at rest, and whether the padding stayed 0."""
    from common.measure.counters import count_collectives
    from common.measure.memory import held_bytes
    from common.models import ResidualMLP
    from common.sharding.zero import ZeRO

    torch.manual_seed(0)
    init = ResidualMLP(width, 1).state_dict()
    x, y = (
        torch.randn(steps, 4 * world_size, 64),
        torch.randint(10, (steps, 4 * world_size)),
    )  # same on every rank
    ref = ResidualMLP(width, 1)
    ref.load_state_dict(init)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for i in range(steps):
        F.cross_entropy(ref(x[i]), y[i]).backward()
        opt.step()
        opt.zero_grad()
    mine = slice(4 * rank, 4 * rank + 4)  # this rank's 4 samples of each global batch of 4 N
    out = {"numel": sum(p.numel() for p in ref.parameters())}
    for stage in (1, 2, 3):
        model = ResidualMLP(width, 1)
        model.load_state_dict(init)
        zero = ZeRO(
            model, [model.stem, *model.blocks, model.head], stage, group=dist.group.WORLD, lr=1e-2
        )
        for i in range(steps):
            with count_collectives() as c:
                F.cross_entropy(model(x[i, mine]), y[i, mine]).backward()
                grads = held_bytes(
                    [],
                    [p.grad for p in model.parameters()] + [u.shard.grad for u in zero.units],
                    zero.optimizer,
                )["gradients"]
                zero.step()
        diff = max(
            (a - b).abs().max().item() for a, b in zip(zero.full_parameters(), ref.parameters())
        )
        out[stage] = {
            "diff": diff,
            "calls": c.calls,
            "bytes": c.bytes,
            "grad_bytes_after_backward": grads,
            "flat_bytes_at_rest": sum(u.flat.untyped_storage().nbytes() for u in zero.units),
            "padded": [u.padded for u in zero.units],
            "padding_zero": zero.padding_is_zero(),
            "state_bytes": held_bytes([], [], zero.optimizer)["optimizer_state"],
        }
    return out
