"""Grader of exercises/predict_memory.py: what rank 0 of ZeRO by hand really keeps, counted from its tensors.

For each unit the grader builds what lesson 13's common/sharding/zero.py builds on rank 0 (a flat buffer of N x s
elements, the parameters as views of it, this rank's shard: a view at stages 1-2, its own tensor at stage 3),
takes the gradient a rank holds at the end of backward (all of them, or the unit's shard), runs torch's Adam
on the shards, and counts storages once (common.measure.memory.storage_bytes). No process group: the bytes a rank
holds do not depend on what it receives, only on what it keeps.
"""

from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from common.measure.memory import storage_bytes
from common.models import ResidualMLP
from common.sharding.zero import flat_units

WORLD_SIZE = 0
FUNCTIONS = ["bytes_per_rank"]
# width 33 at 8 ranks: units of 2145 (stem), 2244 (each block) and 340 (head) elements, none
# divisible by 8, so padding each unit (sum of 8 x ceil(n / 8)) differs from padding the model as one buffer.
CASES = (
    [(33, 2, N, stage) for N in (1, 2, 4) for stage in (0, 1, 2, 3)]
    + [(16, 3, 8, s) for s in (1, 2, 3)]
    + [(33, 2, 8, s) for s in (1, 2, 3)]
)


def units(model: ResidualMLP) -> list[nn.Module]:
    """The flat units' modules (`common.sharding.zero.flat_units`), what a learner's answer is given."""
    return [module for _, module in flat_units(model)]


def measured(width: int, depth: int, N: int, stage: int) -> dict[str, int]:
    torch.manual_seed(0)
    model = ResidualMLP(width, depth)
    F.cross_entropy(model(torch.randn(8, 64)), torch.randint(0, 10, (8,))).backward()
    params = list(model.parameters())
    if stage == 0:
        opt = torch.optim.Adam(params)
        grads = storage_bytes(p.grad for p in params)
        opt.step()
        state = [t for s in opt.state.values() for t in s.values()]
        return {
            "parameters": storage_bytes(params),
            "gradients": grads,
            "optimizer_state": storage_bytes(state),
        }
    flats, shards = [], []
    for u in units(model):
        ps = list(u.parameters())
        n = sum(p.numel() for p in ps)
        s = math.ceil(n / N)
        flat = torch.zeros(N * s)
        offset = 0
        for (
            p
        ) in ps:  # the parameters become views of the flat buffer, as in common/sharding/zero.py
            flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        shard = nn.Parameter(flat[:s] if stage < 3 else flat[:s].clone())  # rank 0's slice
        shard.grad = torch.cat([p.grad.reshape(-1) for p in ps] + [torch.zeros(N * s - n)])[
            :s
        ].clone()
        if stage >= 2:
            for p in ps:
                p.grad = (
                    None  # reduce-scattered and dropped as soon as the unit's gradient is complete
                )
        flats.append(flat)
        shards.append(shard)
    grads = storage_bytes(
        [p.grad for p in params] + ([] if stage == 1 else [s.grad for s in shards])
    )
    opt = torch.optim.Adam(shards)
    opt.step()
    state = [t for s in opt.state.values() for t in s.values()]
    if stage == 3:
        for flat in flats:
            flat.untyped_storage().resize_(0)  # freed between uses
    return {
        "parameters": storage_bytes([*params, *shards]),
        "gradients": grads,
        "optimizer_state": storage_bytes(state),
    }


def one_buffer(numels: list[int], N: int, stage: int) -> dict[str, int]:
    """What rank 0 would hold if the whole model were ONE flat buffer of N x ceil(P / N) elements."""
    P, s = sum(numels), math.ceil(sum(numels) / N)
    return {
        "parameters": 4 * (s if stage == 3 else N * s),
        "gradients": 4 * (P if stage == 1 else s),
        "optimizer_state": 8 * s + 4 * len(numels),
    }


def hint(row: str, stage: int, got: int, want: int, whole: int | None = None) -> str:
    if got == whole and stage > 0:
        return (
            "that is the model padded as ONE flat buffer, N x ceil(P / N); each unit has its own flat "
            "buffer, padded on its own: the sum over units of N x ceil(n / N) (up to N - 1 elements of "
            "padding per unit)"
        )
    if row == "gradients" and stage == 1:
        return (
            "ZeRO-1 shards only the optimizer state: at the end of backward a rank still holds every "
            "gradient (the reduce-scatter happens in step())"
        )
    if row == "optimizer_state" and (want - got) % 4 == 0 and abs(want - got) < 4 * 64:
        return (
            "Adam keeps a 4-byte fp32 `step` for every tensor it updates (DDP: each parameter; ZeRO: "
            "each unit's shard)"
        )
    if row == "optimizer_state":
        return "Adam keeps two fp32 tensors (exp_avg, exp_avg_sq) the size of what it updates"
    if row == "parameters" and stage in (1, 2):
        return (
            "stages 1-2 keep the whole flat buffer of every unit, padding included: N x ceil(n / N)"
        )
    return "pad each unit of n elements to N x ceil(n / N) and keep ceil(n / N) of them per rank"


def check(module: str) -> list[str]:
    mine = importlib.import_module(module).bytes_per_rank
    for width, depth, N, stage in CASES:
        torch.manual_seed(0)
        want = measured(width, depth, N, stage)
        got = mine(units(ResidualMLP(width, depth)), N, stage)
        for row in ("parameters", "gradients", "optimizer_state"):
            if not isinstance(got, dict) or row not in got:
                return [
                    f"return a dict with 'parameters', 'gradients' and 'optimizer_state'; got {got!r}"
                ]
            if got[row] != want[row]:
                kind = "DDP" if stage == 0 else f"ZeRO-{stage}"
                case = f"ResidualMLP width {width} depth {depth}, {N} ranks, {kind}"
                numels = [
                    sum(p.numel() for p in u.parameters()) for u in units(ResidualMLP(width, depth))
                ]
                why = hint(row, stage, got[row], want[row], one_buffer(numels, N, stage)[row])
                return [f"{case}: {row} {got[row]} bytes, measured {want[row]}: {why}"]
    return []
