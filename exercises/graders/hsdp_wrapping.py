"""Grader of exercises/hsdp_wrapping.py: 4 gloo ranks, HSDP 2 x 2 on lesson 13's ResidualMLP, one SGD step
against one process on the global batch; the units, and the group every collective ran in; then the mesh the
parameters live on, for replicate = 2 and 4 (a 2 x 2 mesh is symmetric: 4 x 1 tells the dims apart)."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from common.measure.counters import count_collectives
from common.measure.differences import nan_max
from common.models import ResidualMLP
from exercises.graders._common import answer_diff, rank_failures

WORLD_SIZE = 4
FUNCTIONS = ["shard_hsdp"]
REPLICATE = 2
# replicate values whose mesh is checked: dims named and sized (replicate, world / replicate)
MESHES = (2, 4)
DIM_NAMES = ("dp_replicate", "dp_shard")
SHARD_GROUPS, REPLICA_GROUPS = ([0, 1], [2, 3]), ([0, 2], [1, 3])


def make_model() -> ResidualMLP:
    torch.manual_seed(0)
    return ResidualMLP(16, 2)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)


def sgd(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:  # a gradient never reduced leaves the shard without one
                p -= 0.1 * p.grad


def on_rank(module: str) -> dict:
    shard_hsdp = importlib.import_module(module).shard_hsdp
    rank = dist.get_rank()
    model = shard_hsdp(make_model(), WORLD_SIZE, REPLICATE)
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    x, y = batch()
    b = len(x) // WORLD_SIZE
    with count_collectives() as c:
        F.cross_entropy(
            model(x[rank * b : (rank + 1) * b]), y[rank * b : (rank + 1) * b]
        ).backward()
        sgd(model)
        full = [
            p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()
        ]
    ops = ("reduce_scatter_single", "all_reduce")
    groups = {op: sorted({tuple(r) for (o, r) in c.groups if o == op}) for op in ops}
    params = [t.tolist() for t in full]  # before any other collective
    meshes = {}
    for replicate in MESHES:  # the mesh a parameter's DTensor lives on (no step taken)
        mesh = next(shard_hsdp(make_model(), WORLD_SIZE, replicate).parameters()).device_mesh
        meshes[replicate] = [list(mesh.mesh_dim_names or ()), list(mesh.shape)]
    return {
        "units": units,
        "params": params,
        "groups": groups,
        "meshes": meshes,
    }


def one_process() -> list[torch.Tensor]:
    model = make_model()
    F.cross_entropy(model(batch()[0]), batch()[1]).backward()
    sgd(model)
    return [p.detach() for p in model.parameters()]


def judge(answers: list) -> list[str]:
    problems = rank_failures(answers)
    if problems:
        return problems
    want = one_process()
    for rank, a in enumerate(answers):
        if a["units"] != 3:
            return [
                f"rank {rank}: {a['units']} fully_shard unit(s), expected 3: fully_shard each block "
                "(its own all-gather and reduce-scatter), then the root (the stem and the head)"
            ]
        diff = nan_max(answer_diff(torch.tensor(g), w) for g, w in zip(a["params"], want))
        if not diff <= 1e-5:
            return [
                f"rank {rank}: parameters after one step differ from one process by {diff:.1e}: the "
                "gradients were not averaged over the 4 ranks (leave gradient sync on)"
            ]
        rs, ar = a["groups"]["reduce_scatter_single"], a["groups"]["all_reduce"]
        wrong = [g for g in rs if list(g) not in SHARD_GROUPS]
        wrong += [g for g in ar if list(g) not in REPLICA_GROUPS]
        if not ar or wrong:
            return [
                f"rank {rank}: reduce-scatters in {rs}, all-reduces in {ar}; expected the rows "
                f"{list(SHARD_GROUPS)} and, across replicas, the columns {list(REPLICA_GROUPS)}: a 1-D "
                "mesh of 4 is FSDP; HSDP needs a 2-D mesh (replicate, shard), outer dim first"
            ]
        for replicate, (names, shape) in a["meshes"].items():
            dims = [int(replicate), WORLD_SIZE // int(replicate)]
            if names != list(DIM_NAMES) or shape != dims:
                return [
                    f"rank {rank}: shard_hsdp(model, {WORLD_SIZE}, {replicate}) put the parameters on a "
                    f"mesh named {names} of shape {shape}; expected {list(DIM_NAMES)} of shape {dims}: "
                    "the replicate dim first, of size `replicate`, and the shard dim of world_size // "
                    "replicate (not a fixed 2 x 2)"
                ]
    return []
