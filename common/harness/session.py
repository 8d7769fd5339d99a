"""The harness every lesson runs in: shared options, the process group's life, errors and run_main (lesson 03 on).

Every lesson runs unchanged in three ways:

    python lessons/03_ddp.py                                        # one process, no process group
    torchrun --standalone --nproc_per_node=2 lessons/03_ddp.py      # one node, 2 processes
    torchrun --nnodes=2 --nproc_per_node=2 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --rdzv-id=lessons lessons/03_ddp.py  # on each node

`common.harness.env` reads who this process is; this module turns that into a process group and ends it cleanly.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from common.harness.env import DistInfo, LessonError, choose_backend_and_device, read_torchrun_env
from common.harness.options import add_legacy_launcher_args, legacy_launcher_note
from common.harness.process_exit import (
    exit_process,
    exit_status,
    one_thread_unless_told,
    wait_for_failing_peers,
)
from common.harness.rendezvous import rendezvous_store

__all__ = [
    "add_distributed_args",
    "setup",
    "cleanup",
    "distributed_session",
    "run_main",
    "rank0_only",
    "gloo_group",
    "barrier",
    "set_seed",
    "deterministic_cuda",
]


def add_distributed_args(
    parser: argparse.ArgumentParser, timeout_s: float = 60.0
) -> argparse.ArgumentParser:
    """Add --backend, --device and --timeout-s, the options every lesson shares (and the legacy --local-rank)."""
    add_legacy_launcher_args(parser)
    g = parser.add_argument_group("distributed")
    g.add_argument(
        "--backend",
        choices=["auto", "gloo", "nccl"],
        default="auto",
        help="process-group backend (auto: nccl when every local rank has a GPU, else gloo)",
    )
    g.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="compute device (auto: cuda:LOCAL_RANK when there are enough GPUs, else cpu)",
    )
    g.add_argument(
        "--timeout-s",
        type=float,
        default=timeout_s,
        help="seconds any collective may wait before the process group raises (default %(default)s)",
    )
    return parser


def setup(backend: str = "auto", device: str = "auto", timeout_s: float = 60.0) -> DistInfo:
    """Create the default process group when launched by torchrun; otherwise describe a single process.

    Under torchrun this calls `dist.init_process_group` on the store torchrun prepared, with a `timeout` so that
    a collective some rank never joins raises instead of hanging forever
    (https://pytorch.org/docs/stable/distributed.html#torch.distributed.init_process_group). It is the plain
    env:// call, unless torchrun may restart the job (`--max-restarts` > 0, TORCHELASTIC_MAX_RESTARTS): then the
    group meets in torchrun's store under a prefix per restart attempt that every node agrees on, and
    common/harness/rendezvous.py says why neither env:// nor TORCHELASTIC_RESTART_COUNT will do there.

    Raises:
        LessonError: see `read_torchrun_env` and `choose_backend_and_device`.
    """
    if timeout_s <= 0:
        raise LessonError(f"--timeout-s must be positive, got {timeout_s}")
    rank, local_rank, world_size, local_world_size = read_torchrun_env()
    backend_name, dev = choose_backend_and_device(backend, device, local_rank, local_world_size)
    if dev.type == "cuda":
        deterministic_cuda()
        torch.cuda.set_device(dev)  # before init: NCCL binds this process to cuda:LOCAL_RANK
    if "RANK" not in os.environ:  # plain `python lesson.py`: no process group, world of one
        return DistInfo(device=dev)
    timeout = timedelta(seconds=timeout_s)
    device_id = dev if dev.type == "cuda" else None
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:  # torchrun may restart this job
        dist.init_process_group(
            backend=backend_name,
            store=rendezvous_store(),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device_id,
        )
    else:  # the plain call a reader copies: env:// reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE
        dist.init_process_group(backend=backend_name, timeout=timeout, device_id=device_id)
    return DistInfo(rank, local_rank, world_size, local_world_size, backend_name, dev)


def deterministic_cuda() -> None:
    """Ask CUDA for deterministic kernels, before its first use: the lessons prove equalities bit for bit.

    By default cuDNN and cuBLAS may pick algorithms that sum in a varying order (atomic adds), so two identical
    runs differ by ~1e-7 per step, and a few hundred steps amplify that to ~1e-2: measured on an H200, a resumed
    run against an uninterrupted one, and DDP against its one-process replay. Real training usually leaves this
    off for speed. See https://pytorch.org/docs/stable/notes/randomness.html (CUBLAS_WORKSPACE_CONFIG included);
    `warn_only`: an op without a deterministic CUDA kernel warns instead of raising.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def cleanup() -> None:
    """Destroy the default process group if there is one (call it in a `finally`)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def distributed_session(args: argparse.Namespace) -> Iterator[DistInfo]:
    """`with distributed_session(args) as info:` -- setup from --backend/--device/--timeout-s, cleanup always.

    End the process with `run_main` (or `exit_process`), not by returning to the interpreter: see `run_main` for
    the gloo abort at interpreter exit that this avoids. Tests that spawn worlds end each worker the same way.
    """
    legacy_launcher_note(args)
    try:
        yield setup(args.backend, args.device, args.timeout_s)
    finally:
        cleanup()


@contextmanager
def rank0_only(info: DistInfo, phase: str) -> Iterator[bool]:
    """`with rank0_only(info, "the one-process replay") as mine:` -- rank 0 works, the others wait unbounded.

    A phase that only rank 0 runs (a replay, a reference computation, writing a report) can outlast
    --timeout-s, which bounds every collective on the default group: a plain `dist.barrier()` after it would
    make the waiting ranks raise a raw backend timeout. So the waiting ranks meet rank 0 in a barrier of a
    separate gloo group (CPU, works beside NCCL too) whose timeout is a day, not --timeout-s. If rank 0 dies
    instead, torchrun stops the others. Yields True on rank 0; the body should do nothing when it is False.
    """
    if not info.distributed:  # nobody to wait for
        yield info.master_process
        return
    waiting_room = dist.new_group(
        backend="gloo", timeout=timedelta(days=1)
    )  # every rank creates it
    try:
        yield info.master_process
    finally:
        dist.barrier(group=waiting_room)
        dist.destroy_process_group(waiting_room)


def gloo_group(timeout_s: float, setup_timeout_s: float = 300.0) -> dist.ProcessGroup:
    """A gloo group of every rank whose collectives time out after `timeout_s` (a failure demo's short wait).

    Created under `setup_timeout_s`, then shortened: `new_group` meets every rank in a store barrier and gloo
    connects its pairs, both under the group's own timeout, so with a 1 s timeout a rank that arrives a second
    late (a loaded machine) fails the creation itself. torchtitan's `set_pg_timeouts` does the same thing.
    """
    group = dist.new_group(
        backend="gloo", timeout=timedelta(seconds=max(timeout_s, setup_timeout_s))
    )
    dist.barrier(group=group)  # every rank is past its setup before the short timeout applies
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)
    return group


def run_main(main: Callable[[], object]) -> None:
    """Run a lesson's `main`; turn a `LessonError` into one line on stderr and exit status 2; exit with the
    status `set_exit_status` left (1 when `Report.finish` found a claim that does not hold), else 0.

    Every rank validates the same arguments, so on bad input every rank prints the same line and exits
    non-zero before any collective can wait for a rank that already left.

    The process then ends with `os._exit` after flushing stdout and stderr, skipping interpreter finalization.
    Why: in torch 2.13 a gloo worker thread may still be releasing its last finished all-reduce (whose
    thread-local state holds a Python object) when the interpreter shuts down; it then needs the GIL of a
    finalizing interpreter and the process aborts with "terminate called without an active exception" after
    all its work is done. We measured it in 9 of 65 two-process DDP launches here and in 0 of 40 with this exit
    (backtrace: ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork -> ~ThreadLocalState -> gil_scoped_acquire;
    the same race is described in pytorch/pytorch PR 179291). The process group itself is still destroyed
    by `distributed_session`'s `finally` before we get here. Any other exception prints its traceback and
    exits 1 the same way (the interpreter's own exit would risk the same abort).
    """
    code = 0
    try:
        one_thread_unless_told()
        main()
        code = exit_status()
    except LessonError as e:
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank is not None else ""
        sys.stderr.flush()
        # one write(2) of the whole line: ranks failing together cannot interleave inside it (print() writes
        # the text and the newline separately, and we saw two ranks' lines run together in one pipe)
        os.write(2, f"{prefix}error: {e}\n".encode())
        wait_for_failing_peers()
        code = 2
    except (
        Exception
    ):  # after `@record` (lesson 16) wrote it to this rank's error file: the traceback, exit 1
        traceback.print_exc()
        code = 1
    exit_process(code)


def barrier(info: DistInfo) -> None:
    """dist.barrier() when a process group exists (bounded by the group's timeout)."""
    if info.distributed:
        dist.barrier()


def set_seed(seed: int) -> None:
    """Seed Python's `random`, numpy and torch (CPU and CUDA) with one integer."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
