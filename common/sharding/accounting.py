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

__all__ = [
    "held_bytes",
    "memory_row",
    "moved_bytes",
    "rows_padded_bytes",
    "full_params",
    "activation_bytes",
    "table_text",
]


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
    factor = {
        "all_reduce": 2,
        "all_gather_single": 1,
        "all_gather_into_tensor": 1,
        "reduce_scatter_single": 1,
        "reduce_scatter_tensor": 1,
    }
    return sum(factor.get(op, 0) * b for op, b in counted.items()) * (world_size - 1) / world_size


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
