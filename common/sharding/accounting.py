"""What a sharded rank holds and sends: bytes of parameters, gradients and optimizer state (each storage once, a
DTensor by its local shard), the collectives of ZeRO and FSDP2 counted, and bytes sent per the ring model (lesson 13).

Per rank and call, with Psi the bytes of the buffer a call works on (what `count_collectives` records): a ring
all-reduce sends 2 Psi (N-1)/N, an all-gather or a reduce-scatter Psi (N-1)/N (lesson 02 derives them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.measure.counters import local_shard
from common.measure.memory import storage_bytes

__all__ = ["held_bytes", "moved_bytes", "full_params", "activation_bytes"]


def held_bytes(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    optimizer: torch.optim.Optimizer,
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds, each storage counted once.

    A DTensor (FSDP2) counts its local shard. Stage-3 flat buffers between uses are 0-byte storages.
    """

    def local(ts):
        return [local_shard(t) for t in ts if t is not None]

    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {
        "parameters": storage_bytes(local(params)),
        "gradients": storage_bytes(local(grads)),
        "optimizer_state": storage_bytes(local(state)),
    }


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

    Each saved storage counts once, at its size after the forward: a ZeRO stage-3 unit or an FSDP2 module that
    reshards after forward frees its gathered weights, and the views autograd saved of them then hold 0 bytes
    (they are gathered again in backward). So a sharded model that keeps the activations of DDP shows DDP's
    number, and one that keeps its gathered weights (reshard_after_forward=False) shows more. Every rank calls it
    on a model it will not train further (FSDP2 expects a backward after its forward).
    """
    saved = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    # the parameters at rest (FSDP2 swaps in its gathered ones during forward: those are not excluded)
    params = {local_shard(p).untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = model(x)
    sizes = {}  # storage -> bytes it holds now
    for t in saved:
        storage = local_shard(t).untyped_storage()
        if storage.data_ptr() not in params:
            sizes[storage.data_ptr()] = storage.nbytes()
    del out
    return sum(sizes.values())
