"""Starting a world with `torch.multiprocessing.spawn` instead of torchrun (lesson 03's `--spawn N`).

With torchrun, each process reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from its environment. With
`mp.spawn(fn, args=(...), nprocs=N)` nobody sets them: the parent picks an address and a free port (the children
inherit the environment), and each child is called as `fn(rank, *args)` and passes its rank and the world size
to `init_process_group` by hand. `fn` travels to the children pickled by reference (its module and name), so it
must be importable: see `common.run.spawn` and notebook 03 for what happens when it is not.
https://pytorch.org/docs/stable/multiprocessing.html#spawning-subprocesses
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.harness.env import DistInfo, LessonError, choose_backend_and_device
from common.harness.session import deterministic_cuda, run_main

__all__ = ["free_port", "spawn_world", "spawn_worker"]


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now (the OS picks it): a MASTER_PORT for one world."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_world(train: Callable, nprocs: int, args: argparse.Namespace) -> None:
    """The launcher's work, done by the parent: an address for rank 0's TCPStore, then `nprocs` children that
    each run `train(args, info)` in a process group (`spawn_worker`). A child that fails: one LessonError."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:  # start method "spawn": fresh interpreters that import `train`'s module and unpickle it
        mp.spawn(spawn_worker, args=(nprocs, train, args), nprocs=nprocs, join=True)
    except mp.ProcessExitedException as e:
        raise LessonError(
            f"--spawn: process {e.error_index} exited with status {e.exit_code}"
        ) from None


def spawn_worker(rank: int, world_size: int, train: Callable, args: argparse.Namespace) -> None:
    """mp.spawn calls this in each child, rank first; rank and world size go to init_process_group by hand."""

    def work() -> None:
        backend, device = choose_backend_and_device(args.backend, args.device, rank, world_size)
        if device.type == "cuda":
            deterministic_cuda()  # as setup() does: the equivalence is checked bit for bit
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=args.timeout_s)
        )
        try:
            train(args, DistInfo(rank, rank, world_size, world_size, backend, device))
        finally:
            dist.destroy_process_group()

    run_main(work)  # ends the child with os._exit: 0, or 2 after a one-line error
