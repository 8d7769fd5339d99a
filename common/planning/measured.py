"""What a rank holds and sends, MEASURED from tensors by lessons 08, 10 and 13's instruments (lesson 21).

Lesson 21 holds `common.planning.cost_model`'s predictions to these numbers, byte for byte:

    held = measure_ddp(model, x, y, world_size, distributed)   # one DDP + Adam step: storages, buckets
    held = measure_zero(model, stage, group, x, y, world_size)  # one step of ZeRO by hand (lesson 13)
    gap = gap_over_ranks(held, predicted, distributed)  # sum over ranks and rows of |measured - predicted|

Nothing here predicts: every number is read from the storages a rank holds, the buffers its collectives were
handed (`common.measure.counters`) and the tensors autograd saved (`common.measure.memory`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.harness.session import set_seed
from common.measure.counters import CommCounter, count_collectives
from common.measure.memory import held_bytes, saved_activation_bytes, storage_bytes
from common.models import ResidualMLP
from common.sharding.accounting import moved_bytes
from common.sharding.zero import ZeRO, flat_units

__all__ = [
    "measure_ddp",
    "measure_zero",
    "measure_layouts",
    "measure_tensor_parallel",
    "gap_over_ranks",
]


def measure_ddp(raw: ResidualMLP, x, y, world_size: int, distributed: bool) -> dict:
    """Lesson 08's instruments: one DDP + Adam step of `raw`, then the storages a rank holds, DDP's bucket bytes,
    and the saved activations of one forward (plain and checkpointed). Not distributed: no DDP."""
    model = DDP(raw) if distributed else raw
    counter = CommCounter().register(model) if distributed else CommCounter()
    F.cross_entropy(
        model(x), y
    ).backward()  # warm-up: DDP builds its final buckets after iteration 1
    raw.zero_grad(set_to_none=True)
    opt = torch.optim.Adam(raw.parameters(), lr=1e-3)
    counter.reset()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    held = held_bytes(list(raw.parameters()), [p.grad for p in raw.parameters()], opt)
    held["sent"] = moved_bytes({"all_reduce": counter.bytes}, world_size)
    held["ddp_buckets"] = (
        counter.bytes
    )  # the flat buffers its hook all-reduced: a copy of the gradients
    for ck in (False, True):
        raw.checkpointing = ck
        name = "activations_checkpointed" if ck else "activations"
        held[name] = saved_activation_bytes(raw, lambda: raw(x))
    raw.checkpointing = False
    return held


def measure_zero(m: ResidualMLP, stage: int, group, x, y, world_size: int) -> dict:
    """Lesson 13's instruments: one step of ZeRO by hand; gradients held at the end of backward, parameters
    (flat buffers and shards, each storage once) and Adam state after the step, collective buffers counted."""
    zero = ZeRO(m, [u for _, u in flat_units(m)], stage, group=group, lr=1e-3)
    with count_collectives() as c:
        F.cross_entropy(m(x), y).backward()
        grads = [p.grad for p in m.parameters()] + [u.shard.grad for u in zero.units]
        held_grads = held_bytes([], grads, zero.optimizer)["gradients"]
        zero.step()
    held = held_bytes([*m.parameters(), *(u.shard for u in zero.units)], [], zero.optimizer)
    return {**held, "gradients": held_grads, "sent": moved_bytes(c.bytes, world_size)}


def measure_layouts(width: int, depth: int, seed: int, x, y, group, info) -> dict:
    """{"DDP": ..., "ZeRO-1": ..., "ZeRO-2": ..., "ZeRO-3": ...}: each layout's bytes on this rank, measured on
    a ResidualMLP(width, depth) built afresh at `seed` (the rows of `cost_model.residual_mlp_layout_bytes`)."""
    set_seed(seed)
    raw = ResidualMLP(width, depth).to(info.device)
    measured = {"DDP": measure_ddp(raw, x, y, info.world_size, info.distributed)}
    for stage in (1, 2, 3):
        set_seed(seed)
        model = ResidualMLP(width, depth).to(info.device)
        measured[f"ZeRO-{stage}"] = measure_zero(model, stage, group, x, y, info.world_size)
    return measured


def measure_tensor_parallel(split: torch.nn.Module, x: torch.Tensor) -> dict:
    """Lesson 10's instruments on a tensor-parallel model: the parameter bytes this rank holds, and the calls
    and bytes of the all-reduces of one forward + backward."""
    with count_collectives() as c:
        split(x).square().mean().backward()
    return {
        "parameters": storage_bytes(split.parameters()),
        "all_reduce_calls": c.calls.get("all_reduce", 0),
        "all_reduce_bytes": c.bytes.get("all_reduce", 0),
    }


def gap_over_ranks(measured: dict, predicted: dict, distributed: bool) -> float:
    """Sum over ranks and rows of |measured - predicted|: 0 only if every rank's every row is equal.
    NaN or inf anywhere stays NaN or inf (an equality claim on it fails)."""
    gaps = [abs(float(measured[k]) - float(predicted[k])) for k in predicted]
    t = torch.tensor(gaps, dtype=torch.float64)
    if distributed:
        dist.all_reduce(t)
    return t.sum().item()
