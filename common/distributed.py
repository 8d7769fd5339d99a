"""Process-group setup, rank-aware printing and metric reduction (introduced in lesson 03, used by 02-07).

Every lesson runs unchanged in three ways:

    python lessons/03_ddp.py                                        # one process, no process group
    torchrun --standalone --nproc_per_node=2 lessons/03_ddp.py      # one node, 2 processes
    torchrun --nnodes=2 --nproc_per_node=2 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --rdzv-id=lessons lessons/03_ddp.py  # on each node

torchrun tells each process who it is through environment variables (see
https://pytorch.org/docs/stable/elastic/run.html#environment-variables):

    RANK              global rank, 0 .. WORLD_SIZE-1, unique over all nodes
    LOCAL_RANK        rank on this node, 0 .. LOCAL_WORLD_SIZE-1: the index of *this node's* GPU to use
    WORLD_SIZE        number of processes over all nodes
    LOCAL_WORLD_SIZE  number of processes on this node

`dist.get_rank()` is the global RANK. It equals LOCAL_RANK on one node only: on a second node RANK is 2 or 3
while the GPUs are still cuda:0 and cuda:1. So the device comes from LOCAL_RANK and "am I the process that
writes files" comes from RANK == 0 (`master_process`).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = [
    "LessonError", "DistInfo", "add_distributed_args", "read_torchrun_env", "choose_backend_and_device",
    "setup", "cleanup", "distributed_session", "run_main", "print0", "all_reduce_sum", "global_mean",
    "gather_to_rank0", "max_param_diff_across_ranks", "barrier", "set_seed", "rank0_progress", "peak_rss_mb",
]


class LessonError(ValueError):
    """Bad input or an impossible request: `run_main` prints it as one line on every rank and exits 2."""


@dataclass(frozen=True)
class DistInfo:
    """Who this process is and where it computes.

    Attributes:
        rank: global rank, 0 .. world_size-1.
        local_rank: rank on this node; the GPU index when device is CUDA.
        world_size: number of processes over all nodes (1 for a plain `python` run).
        local_world_size: number of processes on this node.
        backend: "gloo", "nccl" or None when no process group was created (plain `python` run).
        device: torch.device this process computes on (`cuda:LOCAL_RANK` or `cpu`).
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    backend: str | None = None
    device: torch.device = torch.device("cpu")

    @property
    def master_process(self) -> bool:
        """True on global rank 0 only: the one process that prints summaries and writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group exists (any torchrun launch, even with one process)."""
        return self.backend is not None


def add_distributed_args(parser: argparse.ArgumentParser, timeout_s: float = 60.0) -> argparse.ArgumentParser:
    """Add --backend, --device and --timeout-s, the options every lesson shares."""
    g = parser.add_argument_group("distributed")
    g.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                   help="process-group backend (auto: nccl when every local rank has a GPU, else gloo)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="compute device (auto: cuda:LOCAL_RANK when there are enough GPUs, else cpu)")
    g.add_argument("--timeout-s", type=float, default=timeout_s,
                   help="seconds any collective may wait before the process group raises (default %(default)s)")
    return parser


def read_torchrun_env(env: dict | None = None) -> tuple[int, int, int, int]:
    """Read (rank, local_rank, world_size, local_world_size) from torchrun's variables.

    Without RANK in the environment this is a plain `python` run and the answer is (0, 0, 1, 1).

    Raises:
        LessonError: the variables are partial or inconsistent (for example RANK >= WORLD_SIZE).
    """
    env = os.environ if env is None else env
    if "RANK" not in env:
        return 0, 0, 1, 1
    try:
        rank = int(env["RANK"])
        world_size = int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
    except (KeyError, ValueError) as e:
        raise LessonError(f"incomplete torchrun environment ({e}); launch with torchrun") from None
    if not (0 <= rank < world_size and 0 <= local_rank < local_world_size <= world_size):
        raise LessonError(f"inconsistent torchrun environment: RANK={rank} LOCAL_RANK={local_rank} "
                          f"WORLD_SIZE={world_size} LOCAL_WORLD_SIZE={local_world_size}")
    return rank, local_rank, world_size, local_world_size


def choose_backend_and_device(backend: str = "auto", device: str = "auto", local_rank: int = 0,
                              local_world_size: int = 1) -> tuple[str, torch.device]:
    """Pick the backend and device for this process.

    NCCL only moves CUDA tensors and wants one GPU per process; gloo moves CPU tensors (and a few CUDA ops).
    See https://pytorch.org/docs/stable/distributed.html#backends.

    Returns:
        (backend, device): ("nccl", cuda:LOCAL_RANK) when this node has a GPU for every local rank,
        else ("gloo", cpu); explicit choices override.

    Raises:
        LessonError: --device cuda or --backend nccl without (enough) GPUs, nccl with --device cpu, or gloo
            with --device cuda.
    """
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        wants_cuda = backend == "nccl" or (backend == "auto" and n_gpus >= local_world_size)
        device = "cuda" if n_gpus > 0 and wants_cuda else "cpu"
    if device == "cuda":
        if n_gpus == 0:
            raise LessonError("--device cuda: no CUDA GPU is visible (torch.cuda.is_available() is False)")
        if local_rank >= n_gpus:
            raise LessonError(f"--device cuda: LOCAL_RANK {local_rank} needs GPU {local_rank}, "
                              f"but this node has {n_gpus}; start at most {n_gpus} processes per node")
    if backend == "auto":
        backend = "nccl" if device == "cuda" and dist.is_nccl_available() else "gloo"
    if backend == "gloo" and device == "cuda":
        raise LessonError("--backend gloo with --device cuda: gloo's send/recv cannot move CUDA tensors "
                          "(https://pytorch.org/docs/stable/distributed.html#backends); use nccl on GPUs "
                          "or --device cpu")
    if backend == "nccl":
        if n_gpus == 0 or not dist.is_nccl_available():
            raise LessonError("--backend nccl: NCCL needs CUDA GPUs and a CUDA build of PyTorch; "
                              "use --backend gloo on CPU")
        if device != "cuda":
            raise LessonError("--backend nccl communicates CUDA tensors only; it cannot run with --device cpu")
    torch_device = torch.device(f"cuda:{local_rank}") if device == "cuda" else torch.device("cpu")
    return backend, torch_device


def setup(backend: str = "auto", device: str = "auto", timeout_s: float = 60.0) -> DistInfo:
    """Create the default process group when launched by torchrun; otherwise describe a single process.

    Under torchrun this calls `dist.init_process_group` with the env:// rendezvous torchrun prepared and a
    `timeout` so that a collective some rank never joins raises instead of hanging forever
    (https://pytorch.org/docs/stable/distributed.html#torch.distributed.init_process_group).

    Raises:
        LessonError: see `read_torchrun_env` and `choose_backend_and_device`.
    """
    if timeout_s <= 0:
        raise LessonError(f"--timeout-s must be positive, got {timeout_s}")
    rank, local_rank, world_size, local_world_size = read_torchrun_env()
    backend_name, dev = choose_backend_and_device(backend, device, local_rank, local_world_size)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # before init: NCCL binds this process to cuda:LOCAL_RANK
    if "RANK" not in os.environ:  # plain `python lesson.py`: no process group, world of one
        return DistInfo(device=dev)
    dist.init_process_group(backend=backend_name, timeout=timedelta(seconds=timeout_s),
                            device_id=dev if dev.type == "cuda" else None)
    return DistInfo(rank, local_rank, world_size, local_world_size, backend_name, dev)


def cleanup() -> None:
    """Destroy the default process group if there is one (call it in a `finally`)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def distributed_session(args: argparse.Namespace) -> Iterator[DistInfo]:
    """`with distributed_session(args) as info:` -- setup from --backend/--device/--timeout-s, cleanup always."""
    try:
        yield setup(args.backend, args.device, args.timeout_s)
    finally:
        cleanup()


def run_main(main: Callable[[], object]) -> None:
    """Run a lesson's `main`; turn a `LessonError` into one line on stderr and exit status 2.

    Every rank validates the same arguments, so on bad input every rank prints the same line and exits
    non-zero before any collective can wait for a rank that already left.

    The process then ends with `os._exit` after flushing stdout and stderr, skipping interpreter finalization.
    Why: in torch 2.13 a gloo worker thread may still be releasing its last finished all-reduce (whose
    thread-local state holds a Python object) when the interpreter shuts down; it then needs the GIL of a
    finalizing interpreter and the process aborts with "terminate called without an active exception" after
    all its work is done. We measured it in 9 of 65 two-process DDP launches here and in 0 of 40 with this exit
    (backtrace: ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork -> ~ThreadLocalState -> gil_scoped_acquire;
    the same race is described in pytorch/pytorch PR 179291). The process group itself is still destroyed
    by `distributed_session`'s `finally` before we get here.
    """
    code = 0
    try:
        main()
    except LessonError as e:
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank is not None else ""
        sys.stderr.flush()
        # one write(2) of the whole line: ranks failing together cannot interleave inside it (print() writes
        # the text and the newline separately, and we saw two ranks' lines run together in one pipe)
        os.write(2, f"{prefix}error: {e}\n".encode())
        _wait_for_failing_peers()
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _wait_for_failing_peers(timeout_s: float = 10.0) -> None:
    """Under torchrun, wait (at most `timeout_s`) until every rank has reported an error, then return.

    torchrun terminates all workers as soon as one exits non-zero. A rank that is still importing torch when
    its peer fails would be killed before printing its own error line. So each failing rank counts itself in
    torchrun's key-value store (the agent's TCPStore, TORCHELASTIC_USE_AGENT_STORE=True, which exists before any
    process group) and leaves when all WORLD_SIZE ranks have counted themselves, or when the time is up.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size < 2 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    try:
        import time
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        key = f"lessons/failed_ranks/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while store.add(key, 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # no store to reach: exit at once rather than fail differently
        return


def _current_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def print0(*args, **kwargs) -> None:
    """print() on global rank 0 only, flushed (several ranks writing one pipe interleave byte by byte)."""
    if _current_rank() == 0:
        print(*args, **kwargs, flush=True)


def all_reduce_sum(values: Sequence[float], info: DistInfo) -> list[float]:
    """Sum a few numbers over all ranks; every rank gets the sums (float64, so counts stay exact).

    This is how metrics are combined: reduce (sum, count) pairs, then divide once. Averaging per-rank means
    is wrong whenever ranks hold different numbers of samples.
    """
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=info.device)
    if info.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def global_mean(value_sum: float, count: float, info: DistInfo) -> float:
    """sum over ranks of value_sum / sum over ranks of count (the same on every rank).

    Example: ranks holding 4, 3 and 3 samples with 4, 0 and 0 correct give 4/10 = 0.4, where the mean of
    per-rank accuracies would give (1 + 0 + 0)/3 = 0.333.

    Raises:
        ZeroDivisionError: no rank holds any sample.
    """
    total, n = all_reduce_sum([value_sum, count], info)
    if n == 0:
        raise ZeroDivisionError("global_mean over zero samples")
    return total / n


def gather_to_rank0(obj: object, info: DistInfo) -> list | None:
    """Collect one picklable object per rank on rank 0, in rank order; other ranks get None.

    Uses `dist.gather_object` (https://pytorch.org/docs/stable/distributed.html#torch.distributed.gather_object),
    so rank 0 can print per-rank facts in order instead of every rank printing at once.
    """
    if not info.distributed:
        return [obj]
    out = [None] * info.world_size if info.master_process else None
    dist.gather_object(obj, out, dst=0)
    return out


@torch.no_grad()
def max_param_diff_across_ranks(model: nn.Module, info: DistInfo) -> float:
    """Largest |p_rank - p_rank0| over every parameter and rank (0.0 means bit-identical replicas).

    Rank 0's parameters are broadcast and compared on each rank; the maxima are all-reduced with MAX, so every
    rank returns the same number.
    """
    if not info.distributed:
        return 0.0
    worst = torch.zeros((), dtype=torch.float64, device=info.device)
    for p in model.parameters():
        ref = p.detach().clone()
        dist.broadcast(ref, src=0)
        worst = torch.maximum(worst, (p.detach() - ref).abs().max().double())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def barrier(info: DistInfo) -> None:
    """dist.barrier() when a process group exists (bounded by the group's timeout)."""
    if info.distributed:
        dist.barrier()


def set_seed(seed: int) -> None:
    """Seed Python's `random`, numpy and torch (CPU and CUDA) with one integer."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank0_progress(iterable: Iterable, info: DistInfo, **tqdm_kwargs) -> Iterable:
    """A tqdm progress bar on rank 0 when stderr is a terminal; the bare iterable otherwise.

    Captured runs (tests, notebooks, CI logs) therefore show only the lesson's deterministic per-epoch lines.
    """
    if info.master_process and sys.stderr.isatty():
        from tqdm.auto import tqdm
        return tqdm(iterable, leave=False, **tqdm_kwargs)
    return iterable


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MB (Linux `ru_maxrss` is in KiB)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
