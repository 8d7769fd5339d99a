"""Worker functions for lesson 06's tests (spawned by torch.multiprocessing, so importable).

- `proof_worker` (tests/lessons/test_06_sync_batchnorm.py) joins a gloo process group through a FileStore, runs
  every case for its world size and writes rank{R}.json into `out_dir`: the largest differences between the
  from-scratch SyncBatchNorm on this rank's share of a global batch and nn.BatchNorm on the whole (concatenated)
  batch of this rank's process group.
- `buffer_broadcast_rule` (tests/unit/test_sync_batchnorm.py, through tests._workers.run_world) counts DDP's
  buffer broadcasts per kind of forward and checks `global_batch_tracker` against BatchNorm on the global batch.
"""

from __future__ import annotations

import copy
import json
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from common.data_parallel.sync_batchnorm import convert_sync_batchnorm
from common.harness.process_exit import exit_process
from common.measure.counters import count_collectives
from common.models import DigitsCNN

C = 3  # channels

# world_size -> cases: (name, per-rank batch sizes, spatial size, momentum, process groups or None)
CASES = {
    2: [
        ("uneven", [3, 5], 4, 0.1, None),
        ("one_sample_per_rank", [1, 1], 1, 0.1, None),
    ],  # 1 value per channel per rank, 2 globally
    3: [
        ("uneven", [2, 5, 1], 4, 0.1, None),
        ("cumulative_momentum_none", [4, 1, 3], 4, None, None),
        ("empty_rank", [3, 0, 2], 4, 0.1, None),
    ],
    4: [
        ("uneven", [4, 1, 3, 2], 4, 0.1, None),
        ("groups_01_23", [4, 1, 3, 2], 4, 0.1, [[0, 1], [2, 3]]),
    ],
}
STEPS = 2  # two training steps: running statistics are updated twice


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (
        (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item()
        if a.numel()
        else 0.0
    )


def run_case(
    rank: int, world_size: int, sizes, spatial: int, momentum, groups, device, seed: int = 0
) -> dict:
    """Compare one rank's from-scratch SyncBatchNorm with BatchNorm on its group's concatenated batch."""
    pg, members = None, list(range(world_size))
    if groups:
        handles = [dist.new_group(g) for g in groups]  # every rank creates every group
        idx = next(i for i, g in enumerate(groups) if rank in g)
        pg, members = handles[idx], groups[idx]
    g = torch.Generator().manual_seed(seed)
    ref = nn.BatchNorm2d(C, momentum=momentum)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(C, generator=g) + 0.5)
        ref.bias.copy_(torch.randn(C, generator=g))
    mine = convert_sync_batchnorm(copy.deepcopy(ref), process_group=pg).to(device)
    diffs = {k: 0.0 for k in ("out", "dx", "dweight", "dbias", "running_mean", "running_var")}
    for _ in range(STEPS):
        # The same global batch on every rank (same generator), offset so that |mean| >> std is exercised.
        xs = [torch.randn(b, C, spatial, spatial, generator=g) * 2 + 5 for b in sizes]
        gs = [torch.randn(b, C, spatial, spatial, generator=g) for b in sizes]
        x_ref = torch.cat([xs[r] for r in members]).requires_grad_()
        ref.weight.grad = ref.bias.grad = None
        y_ref = ref(x_ref)
        (y_ref * torch.cat([gs[r] for r in members])).sum().backward()

        x = xs[rank].to(device).requires_grad_()
        mine.weight.grad = mine.bias.grad = None
        y = mine(x)
        (y * gs[rank].to(device)).sum().backward()
        # weight/bias gradients are per-rank shares (DDP would add them): sum them over the group to compare.
        dw, db = mine.weight.grad.clone(), mine.bias.grad.clone()
        dist.all_reduce(dw, group=pg)
        dist.all_reduce(db, group=pg)
        lo = sum(sizes[r] for r in members[: members.index(rank)])
        mine_slice = slice(lo, lo + sizes[rank])
        for k, a, b in [
            ("out", y, y_ref[mine_slice]),
            ("dx", x.grad, x_ref.grad[mine_slice]),
            ("dweight", dw, ref.weight.grad),
            ("dbias", db, ref.bias.grad),
            ("running_mean", mine.running_mean, ref.running_mean),
            ("running_var", mine.running_var, ref.running_var),
        ]:
            diffs[k] = max(diffs[k], _max_diff(a, b))
    diffs["num_batches_tracked"] = [int(mine.num_batches_tracked), int(ref.num_batches_tracked)]
    # sanity: the running statistics compared really moved away from their initial values (mean 0, var 1)
    diffs["running_stats_moved"] = min(
        ref.running_mean.abs().max().item(), (ref.running_var - 1).abs().max().item()
    )
    return diffs


def count_case(rank: int, device) -> dict:
    """Collective calls of the converted digits CNN: training forward/backward, and an eval-mode forward."""
    torch.manual_seed(0)
    model = convert_sync_batchnorm(DigitsCNN()).to(device)
    x = torch.randn(2 + rank, 1, 8, 8, device=device)
    with count_collectives() as fwd:
        loss = model(x).sum()
    with count_collectives() as bwd:
        loss.backward()
    model.eval()
    stats_before = model.features[1].running_mean.clone()
    with count_collectives() as ev, torch.no_grad():
        model(x)
    return {
        "train_forward": fwd.calls,
        "train_backward": bwd.calls,
        "eval_forward": ev.calls,
        "eval_changed_running_mean": not torch.equal(stats_before, model.features[1].running_mean),
    }


def torch_case(rank: int, world_size: int, device) -> dict:
    """From-scratch SyncBatchNorm against nn.SyncBatchNorm on CUDA, uneven per-rank batches (local grads)."""
    sizes = [3, 5, 2, 4][:world_size]
    g = torch.Generator().manual_seed(1)
    ref = nn.BatchNorm2d(C)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(C, generator=g) + 0.5)
        ref.bias.copy_(torch.randn(C, generator=g))
    theirs = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref)).to(device)
    mine = convert_sync_batchnorm(copy.deepcopy(ref)).to(device)
    diffs = {}
    for _ in range(STEPS):
        xs = [torch.randn(b, C, 4, 4, generator=g) * 2 + 5 for b in sizes]
        gs = [torch.randn(b, C, 4, 4, generator=g) for b in sizes]
        outs = []
        for m in (theirs, mine):
            m.weight.grad = m.bias.grad = None
            x = xs[rank].to(device).requires_grad_()
            y = m(x)
            (y * gs[rank].to(device)).sum().backward()
            outs.append((y, x.grad, m.weight.grad, m.bias.grad, m.running_mean, m.running_var))
        for k, a, b in zip(("out", "dx", "dweight", "dbias", "running_mean", "running_var"), *outs):
            diffs[k] = max(diffs.get(k, 0.0), _max_diff(a, b))
    return diffs


def proof_worker(
    rank: int, world_size: int, init_file: str, out_dir: str, device_type: str = "cpu"
) -> None:
    """Entry point for mp.spawn: run CASES[world_size] (and the counting case at world size 4)."""
    if device_type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        # NCCL needs one GPU per rank; gloo also moves CUDA tensors, so one GPU can host every rank.
        backend = "nccl" if torch.cuda.device_count() >= world_size else "gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        out = {}
        if device_type == "cuda":
            out["torch"] = torch_case(rank, world_size, device)
        else:
            for name, sizes, spatial, momentum, groups in CASES[world_size]:
                out[name] = run_case(rank, world_size, sizes, spatial, momentum, groups, device)
            if world_size == 4:
                out["counts"] = count_case(rank, device)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()
    exit_process(
        0
    )  # skip interpreter finalization: the gloo exit abort (common.harness.session.run_main)


def buffer_broadcast_rule(rank: int, world_size: int) -> dict:
    """DDP(forward_sync_buffers=True) on Linear + BatchNorm1d: broadcasts counted per kind of forward, in order;
    whether `broadcast_buffers=` warns; and the global-batch tracker against BatchNorm on the concatenated batch."""
    import warnings
    from contextlib import nullcontext

    from torch.nn.parallel import DistributedDataParallel as DDP

    from common.data_parallel.bn_stats import running_stats
    from common.data_parallel.ddp_buffers import count_buffer_broadcasts

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DDP(copy.deepcopy(model), broadcast_buffers=False)
    warned = any(
        issubclass(w.category, FutureWarning) and "broadcast_buffers" in str(w.message)
        for w in caught
    )
    ddp, off = DDP(copy.deepcopy(model)), DDP(copy.deepcopy(model), forward_sync_buffers=False)
    xs = [
        torch.randn(6, 4, generator=torch.Generator().manual_seed(r)) * (r + 1)
        for r in range(world_size)
    ]
    x = xs[rank]  # different data on every rank: the buffers drift unless they are broadcast

    def step(m=ddp, sync=True, grad=True):
        with nullcontext() if sync else m.no_sync(), nullcontext() if grad else torch.no_grad():
            out = m(x).sum()
            if grad:
                out.backward()

    counts = {}
    scenarios = [
        ("3 training steps", [{}] * 3),
        ("3 forwards under no_grad", [{"grad": False}] * 3),
        ("the training step after them", [{}]),
        (
            "2 optimizer steps of 3 micro-steps, no_sync on 2",
            [{"sync": False}] * 2 + [{}] + [{"sync": False}] * 2 + [{}],
        ),
        ("1 no_sync micro-step, then 1 synced", [{"sync": False}, {}]),
        ("forward_sync_buffers=False, 3 training steps", [{"m": off}] * 3),
    ]
    for name, kinds in scenarios:
        with count_buffer_broadcasts() as sent:
            for kw in kinds:
                step(**kw)
        counts[name] = len(sent)
    gathered = [torch.empty(8, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(gathered, running_stats(off))
    off_spread = (
        (torch.stack(gathered).max(0).values - torch.stack(gathered).min(0).values).max().item()
    )
    return {"counts": counts, "warned": warned, "off_spread": off_spread, **_tracker(model, xs, x)}


def _tracker(model: nn.Module, xs: list, x: torch.Tensor) -> dict:
    """The global-batch tracker beside a plain copy: its statistics against BatchNorm1d over every rank's x
    concatenated, how far they moved, whether the output changed, and the hooks it leaves behind."""
    from common.data_parallel.bn_stats import global_batch_tracker, running_stats

    plain, twin, ref = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model[1])
    with global_batch_tracker(plain) as tracker, torch.no_grad():
        for _ in range(2):
            out, out_twin = plain(x), twin(x)
            ref(model[0](torch.cat(xs)))
    return {
        "tracker_vs_global": (running_stats(tracker) - running_stats(ref)).abs().max().item(),
        "tracker_moved": (running_stats(ref) - running_stats(model)).abs().max().item(),
        "output_changed": (out - out_twin).abs().max().item(),
        "hooks_left": len(plain[1]._forward_pre_hooks),
    }
