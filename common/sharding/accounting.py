"""What a sharded rank holds and sends: bytes of parameters, gradients and optimizer state (each storage once, a
DTensor by its local shard), the collectives of ZeRO and FSDP2 counted, and bytes sent per the ring model (lesson 13).

Per rank and call, with Psi the bytes of the buffer a call works on (what `count_collectives` records): a ring
all-reduce sends 2 Psi (N-1)/N, an all-gather or a reduce-scatter Psi (N-1)/N (lesson 02 derives them).
"""

from __future__ import annotations

import torch

from common.measure.bandwidth import ring_bytes_sent
from common.measure.memory import held_bytes, saved_bytes

__all__ = [
    "memory_row",
    "moved_bytes",
    "rows_padded_bytes",
    "full_params",
    "activation_bytes",
    "table_text",
]


def memory_row(
    params, optimizer, grad_bytes: int, activations: int, moved: float
) -> dict[str, float]:
    """What one rank holds and sends: parameters at rest and optimizer state (`held_bytes`), the gradients held
    at the end of backward, the activations held at the end of forward, the bytes sent per step."""
    held = held_bytes(list(params), [], optimizer)
    return {**held, "gradients": grad_bytes, "activations": activations, "moved": moved}


def moved_bytes(counted: dict[str, int], world_size: int) -> float:
    """Bytes one rank sends per the ring model, from full-buffer byte counts {op: bytes}: all-reduce 2 Psi (N-1)/N,
    all-gather and reduce-scatter Psi (N-1)/N each (Psi = the buffer a call works on)."""
    ring = {
        "all_reduce": "all_reduce",
        "all_gather_single": "all_gather",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_single": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter",
    }
    return sum(ring_bytes_sent(ring[op], b, world_size) for op, b in counted.items() if op in ring)


def rows_padded_bytes(model: torch.nn.Module, world_size: int) -> int:
    """Bytes of a model's parameters as fully_shard lays them out: each parameter's dim 0 (its rows) padded to a
    multiple of the world size (Shard(0) on a 1-D mesh), so that every rank holds ceil(rows / N) of them."""
    n = sum(-(-p.shape[0] // world_size) * world_size * p[0].numel() for p in model.parameters())
    return 4 * n  # float32


def table_text(table: dict[str, dict[str, float]]) -> str:
    """A table {row: {column: bytes}} as aligned text, one line per row under a header of the columns."""
    cols = list(next(iter(table.values())))
    lines = [f"  {'':<9}" + "".join(f"{c:>16}" for c in cols)]
    lines += [f"  {k:<9}" + "".join(f"{row[c]:>16.0f}" for c in cols) for k, row in table.items()]
    return "\n".join(lines)


def full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """The whole parameters of a plain or FSDP2 model, in order (a DTensor is all-gathered: every rank calls it)."""
    return [
        p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()
    ]


def activation_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd still holds for backward at the END of one forward of `model` on `x`, parameters excluded.

    `common.measure.memory.saved_bytes` counts them; each saved storage counts once, at its size after the
    forward (`SavedBytes.held_now`): a ZeRO stage-3 unit or an FSDP2 module that reshards after forward frees its
    gathered weights, and the views autograd saved of them then hold 0 bytes (they are gathered again in
    backward). So a sharded model that keeps the activations of DDP shows DDP's number, and one that keeps its
    gathered weights (reshard_after_forward=False) shows more. Every rank calls it on a model it will not train
    further (FSDP2 expects a backward after its forward).
    """
    # the parameters at rest (FSDP2 swaps in its gathered ones during forward: those are not excluded)
    with saved_bytes(exclude=list(model.parameters())) as saved:
        out = model(x)
    held = saved.held_now()
    del out
    return held
