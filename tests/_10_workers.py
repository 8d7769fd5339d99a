"""Worker functions for tests/unit/test_tensor_parallel.py (spawned by tests._workers.run_world; importable so
that `spawn` can pickle them)."""

from __future__ import annotations

import torch


def hand_built_blocks(rank: int, world_size: int) -> dict:
    """The hand-built split MLP, attention and whole model against the unsplit ones on this tp group: output,
    input-gradient and weight-gradient differences, and the collectives counted in forward and in backward."""
    from common.harness.env import DistInfo
    from common.harness.grid import Grid
    from common.measure.counters import count_collectives
    from common.tensor_parallel.layers import (
        MLP,
        TPMLP,
        SelfAttention,
        TPAttention,
        digits_transformer,
        max_shard_diff,
        tensor_parallelize,
    )

    grid = Grid(DistInfo(rank=rank, world_size=world_size, backend="gloo"), tp=world_size)
    tp = (grid.coords["tp"], grid.size("tp"), grid.group("tp"))
    torch.manual_seed(0)
    cases = {"mlp": (MLP(16), TPMLP), "attention": (SelfAttention(16, 4), TPAttention)}
    out = {}
    for name, (full, split_cls) in cases.items():
        split = split_cls(full, *tp)
        x = torch.randn(3, 5, 16)  # (B, S, H), the same on every rank (same seed)
        xs, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        full(xf).square().sum().backward()
        with count_collectives() as fwd:
            y = split(xs)
        with count_collectives() as bwd:
            y.square().sum().backward()
        out[name] = {
            "out": (y - full(xf)).abs().max().item(),
            "in_grad": (xs.grad - xf.grad).abs().max().item(),
            "w_grad": max_shard_diff(full, split, tp[0], grads=True),
            "fwd": (fwd.calls, fwd.bytes, fwd.groups),
            "bwd": (bwd.calls, bwd.bytes, bwd.groups),
            "weight_numel": sum(
                p.numel() for n, p in split.named_parameters() if n.endswith("weight")
            ),
            "full_weight_numel": sum(
                p.numel() for n, p in full.named_parameters() if n.endswith("weight")
            ),
        }
    model = digits_transformer(16, 4, 2)
    split = tensor_parallelize(model, *tp)
    x = torch.rand(4, 8, 8)
    model(x).sum().backward()
    split(x).sum().backward()
    out["model"] = {
        "w_grad": max_shard_diff(model, split, tp[0], grads=True),
        "names": [n for n, _ in split.named_parameters()]
        == [n for n, _ in model.named_parameters()],
    }
    return out


def dtensor_mlp_counts(rank: int, world_size: int) -> dict:
    """parallelize_module on the tp mesh: output difference, and DTensor's collectives in forward and backward as
    common.measure.dtensor_counts sees them."""
    import copy

    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from common.harness.env import DistInfo
    from common.harness.grid import Grid
    from common.measure.dtensor_counts import count_dtensor_collectives
    from common.tensor_parallel.layers import MLP

    grid = Grid(DistInfo(rank=rank, world_size=world_size, backend="gloo"), tp=world_size)
    torch.manual_seed(0)
    full = MLP(16)
    split = parallelize_module(
        copy.deepcopy(full),
        grid.submesh("tp"),
        {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()},
    )
    x = torch.randn(3, 5, 16, requires_grad=True)
    with count_dtensor_collectives() as fwd:
        y = split(x)
    with count_dtensor_collectives() as bwd:
        y.sum().backward()
    return {
        "out": (y - full(x)).abs().max().item(),
        "fwd": (fwd.calls, fwd.bytes, fwd.groups),
        "bwd": (bwd.calls, bwd.bytes, bwd.groups),
    }


def nan_on_one_rank(rank: int, world_size: int) -> dict:
    """Each rank offers 0.0 except the last, which offers NaN (or inf): what the over-ranks maxima return.
    gloo's own MAX keeps rank 0's 0.0 here (the NaN is on a later rank)."""
    import torch.distributed as dist

    from common.checkpoint.train_state import max_diff_over_ranks
    from common.harness.env import DistInfo
    from common.measure.differences import max_over_ranks

    info = DistInfo(rank=rank, world_size=world_size, backend="gloo")
    last = rank == world_size - 1
    out = {}
    for name, bad in (("nan", float("nan")), ("inf", float("inf"))):
        raw = torch.tensor([bad if last else 0.0], dtype=torch.float64)
        dist.all_reduce(raw, op=dist.ReduceOp.MAX)
        model = torch.nn.Linear(2, 2)
        ref = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            model.weight[1, 1] = bad if last else model.weight[1, 1]
        out[name] = {
            "gloo_max": raw.item(),
            "max_over_ranks": max_over_ranks(bad if last else 0.0),
            "max_diff_over_ranks": max_diff_over_ranks(model, ref, info),
        }
    return out


def finish_statuses(rank: int, world_size: int) -> dict:
    """Report.finish on a real world: rank 0's claims decide every rank's exit status (a claim only rank 0
    measures is recorded on the others with a placeholder that may not hold)."""
    from common.harness import process_exit
    from common.harness.env import DistInfo
    from common.harness.results import Report

    info = DistInfo(rank=rank, world_size=world_size, backend="gloo")
    out = {}
    for case, rank0_value in (("rank0_holds", 0.0), ("rank0_fails", 1.0)):
        report = Report(info)
        report.claim("measured_on_rank0", rank0_value if rank == 0 else 1.0, "<=", 1e-5, "{value}")
        out[case] = report.finish(None)
        process_exit.set_exit_status(0)
    return out
