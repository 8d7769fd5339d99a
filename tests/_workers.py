"""Helpers for tests that need a real process group inside pytest: spawn gloo worlds on loopback.

Worker functions must live in an importable module (not in a test body) so that `spawn` can pickle them.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.harness.process_exit import exit_process

# A world's processes fork from one server process that has imported torch and the workers' modules once
# (forkserver), instead of each importing torch afresh (spawn: about 1.3 s of CPU per process). The server
# runs no torch code, so each rank starts as a spawned one would: no threads, default random state. One
# difference: the server starts with this process's environment at the first world, and later changes to
# os.environ do not reach the ranks (no test makes any; `_entry` sets RANK and the rest itself). Spawn where
# forkserver does not exist (Windows).
START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
if START_METHOD == "forkserver":
    mp.set_forkserver_preload(["torch", "torch.distributed", "tests._workers"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    exit_process(
        0
    )  # skip interpreter finalization: the gloo exit abort (common.harness.session.run_main)


def run_world(fn, world_size: int, tmp_path: Path, *args, timeout_s: float = 60) -> list:
    """Run `fn(rank, world_size, *args)` in `world_size` gloo processes; return each rank's return value.

    Raises:
        TimeoutError: the world did not finish within `timeout_s` (its processes are terminated).
    """
    ctx = mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), str(tmp_path), args),
        nprocs=world_size,
        join=False,
        start_method=START_METHOD,
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"world of {world_size} did not finish in {timeout_s} s")
    return [
        torch.load(Path(tmp_path) / f"rank{r}.pt", weights_only=False) for r in range(world_size)
    ]


# ---- workers used by tests/test_common.py -------------------------------------------------------------------


class FirstTwoRight(torch.nn.Module):
    """x (B, 1) holds each sample's index; predicts its label (0) only for indices 0 and 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        right = (x[:, 0] < 2).float()
        return torch.stack([right, 1 - right], dim=1)  # class 0 wins iff index < 2


def eval_ten_samples(rank: int, world_size: int):
    from torch.utils.data import DistributedSampler, TensorDataset

    from common.harness.env import DistInfo
    from common.harness.metrics import evaluate

    data = TensorDataset(torch.arange(10.0).unsqueeze(1), torch.zeros(10, dtype=torch.long))
    info = DistInfo(rank=rank, world_size=world_size, backend="gloo")
    mine = list(DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False))
    return {"indices": mine, "eval": evaluate(FirstTwoRight(), data, info, batch_size=3)}


def accuracy_4_3_3(rank: int, world_size: int):
    from common.harness.env import DistInfo
    from common.harness.ranks import global_mean

    held, correct = [4, 3, 3][rank], [4, 0, 0][rank]
    info = DistInfo(rank=rank, world_size=world_size, backend="gloo")
    return {"global": global_mean(correct, held, info), "mean_of_means_part": correct / held}


def param_diff(rank: int, world_size: int, perturb: float, on: int = -1):
    """max_param_diff_across_ranks of a Linear(4, 3) whose weight[0, 0] moves by `perturb` on rank `on` (the
    last by default); a NaN or inf `perturb` makes that weight NaN or inf there."""
    from common.harness.env import DistInfo
    from common.harness.ranks import max_param_diff_across_ranks

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    if rank == on % world_size:
        with torch.no_grad():
            model.weight[0, 0] += perturb
    return max_param_diff_across_ranks(
        model, DistInfo(rank=rank, world_size=world_size, backend="gloo")
    )


def grid_facts(rank: int, world_size: int, sizes: dict):
    """This rank's grid coordinates, group members (from the grid and from the process group itself), and the
    sum of global ranks all-reduced inside each named group."""
    import torch.distributed as dist

    from common.harness.env import DistInfo
    from common.harness.grid import Grid

    grid = Grid(DistInfo(rank=rank, world_size=world_size, backend="gloo"), **sizes)
    facts = {
        "coords": grid.coords,
        "ranks_in": {},
        "group_ranks": {},
        "sums": {},
        "describe": grid.describe(),
    }
    for name in sizes:
        facts["ranks_in"][name] = grid.ranks_in(name)
        facts["group_ranks"][name] = dist.get_process_group_ranks(grid.group(name))
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=grid.group(name))
        facts["sums"][name] = t.item()
    return facts


def rank0_phase(rank: int, world_size: int, mode: str):
    """Rank 0 works alone for 2.5 s while the collective timeout is 1 s: with `rank0_only` the others wait
    without that bound and a collective afterwards succeeds; with a plain barrier the waiting rank times out."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from common.harness.env import DistInfo
    from common.harness.session import rank0_only

    short = dist.new_group(backend="gloo", timeout=timedelta(seconds=1))  # stands for --timeout-s 1
    info = DistInfo(rank=rank, world_size=world_size, backend="gloo")
    if mode == "rank0_only":
        with rank0_only(info, "a slow rank-0 phase") as mine:
            if mine:
                time.sleep(2.5)
        t = torch.ones(1)
        dist.all_reduce(t, group=short)
        return t.item()
    if rank == 0:
        time.sleep(2.5)
    try:
        dist.barrier(group=short)
        return "no error"
    except Exception as e:  # gloo raises on timeout (DistBackendError / RuntimeError)
        return type(e).__name__


def count_two_collectives(rank: int, world_size: int):
    """count_collectives in a real world: an all_reduce of 10 float32 and an all_gather_into_tensor to 2 x 3."""
    import torch.distributed as dist

    from common.measure.counters import count_collectives

    with count_collectives() as c:
        dist.all_reduce(torch.ones(10))
        out = torch.empty(world_size * 3)
        dist.all_gather_into_tensor(out, torch.ones(3))
    return {
        "calls": c.calls,
        "bytes": c.bytes,
        "groups": c.groups,
        "restored": dist.all_reduce.__name__,
    }
