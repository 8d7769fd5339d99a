"""Worker functions for tests/unit/test_ring_attention.py (spawned by tests._workers.run_world)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def whole_and_mine(split, rank: int, shape=(2, 4, 16, 8)):
    """q, k, v of the whole sequence (the same on every rank) and this rank's tokens of each, as leaves."""
    torch.manual_seed(0)
    whole = [torch.randn(shape, dtype=torch.float64).requires_grad_() for _ in range(3)]
    mine = [split.take(t.detach(), rank, 2).requires_grad_() for t in whole]
    return whole, mine


def ring_vs_sdpa(rank: int, world_size: int, kind: str, ulysses: bool = False) -> dict:
    """Ring (or Ulysses) attention on this rank's tokens vs SDPA on the whole sequence: output and q, k, v
    gradients (this rank's rows), the RingStats and whose key block the ring held at each step (from the
    values that arrived). Ulysses gets 2 heads per rank: with one, a wrong head order cannot show."""
    from common.context_parallel.ring_attention import RingStats, Split, owners, ring_attention
    from common.context_parallel.ulysses import ulysses_attention

    split = Split(kind, world_size)
    whole, mine = whole_and_mine(split, rank, (2, 2 * world_size if ulysses else 4, 16, 8))
    ref = F.scaled_dot_product_attention(*whole, is_causal=True)
    dout = torch.randn_like(ref)  # the same upstream gradient everywhere (same seed)
    ref.backward(dout)
    stats = RingStats(blocks=[])
    group = dist.group.WORLD
    out = (
        ulysses_attention(*mine, group=group)
        if ulysses
        else ring_attention(*mine, split, group, stats)
    )
    out.backward(split.take(dout, rank, 2))
    diffs = [(out - split.take(ref.detach(), rank, 2)).abs().max().item()]
    diffs += [
        (m.grad - split.take(w.grad, rank, 2)).abs().max().item() for m, w in zip(mine, whole)
    ]
    held = owners(stats.blocks, whole[1].detach(), split)
    return {"diffs": diffs, "pairs": stats.pairs, "sent": dict(stats.sent), "held": held}


def minimal_19_check(rank: int, world_size: int, bad: float) -> bool:
    """minimal/19_context_parallel.py's check() on every rank, rank 1's diff replaced by `bad`."""
    import runpy

    from common.run.processes import REPO_ROOT

    path = (
        REPO_ROOT / "minimal" / "19_context_parallel.py"
    )  # a script, not a module: run it, not as __main__
    script = runpy.run_path(
        str(path), run_name="minimal_19"
    )  # defines the functions; main() does not run
    return script["check"](torch.tensor(bad if rank == 1 else 1e-7))
