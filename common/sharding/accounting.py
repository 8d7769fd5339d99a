"""What a sharded rank holds and sends: bytes of parameters, gradients and optimizer state (each storage once, a
DTensor by its local shard), the collectives of ZeRO and FSDP2 counted, and bytes sent per the ring model (lesson 13).

Per rank and call, with Psi the bytes of the buffer a call works on (what `count_collectives` records): a ring
all-reduce sends 2 Psi (N-1)/N, an all-gather or a reduce-scatter Psi (N-1)/N (lesson 02 derives them).
"""

from __future__ import annotations

import torch

from common.measure.memory import held_bytes, saved_bytes  # held_bytes: lesson 13's import, for now

__all__ = ["held_bytes", "moved_bytes", "full_params", "activation_bytes"]


def moved_bytes(counted: dict[str, int], world_size: int) -> float:
    """Bytes one rank sends per the ring model, from full-buffer byte counts {op: bytes}: all-reduce 2 Psi (N-1)/N,
    all-gather and reduce-scatter Psi (N-1)/N each (Psi = the buffer a call works on)."""
    factor = {
        "all_reduce": 2,
        "all_gather_single": 1,
        "all_gather_into_tensor": 1,
        "reduce_scatter_single": 1,
        "reduce_scatter_tensor": 1,
    }
    return sum(factor.get(op, 0) * b for op, b in counted.items()) * (world_size - 1) / world_size


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
