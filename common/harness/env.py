"""Who this process is and where it computes: torchrun's variables, the backend and the device (lesson 03 on).

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

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["LessonError", "DistInfo", "read_torchrun_env", "choose_backend_and_device"]


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

    @property
    def device_ids(self) -> list[int] | None:
        """What DDP's `device_ids` takes: [local_rank] on a GPU, None on the CPU (lesson 03 shows it inline)."""
        return [self.local_rank] if self.device.type == "cuda" else None


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
        raise LessonError(
            f"inconsistent torchrun environment: RANK={rank} LOCAL_RANK={local_rank} "
            f"WORLD_SIZE={world_size} LOCAL_WORLD_SIZE={local_world_size}"
        )
    return rank, local_rank, world_size, local_world_size


def choose_backend_and_device(
    backend: str = "auto", device: str = "auto", local_rank: int = 0, local_world_size: int = 1
) -> tuple[str, torch.device]:
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
            raise LessonError(
                "--device cuda: no CUDA GPU is visible (torch.cuda.is_available() is False)"
            )
        if local_rank >= n_gpus:
            raise LessonError(
                f"--device cuda: LOCAL_RANK {local_rank} needs GPU {local_rank}, "
                f"but this node has {n_gpus}; start at most {n_gpus} processes per node"
            )
    if backend == "auto":
        backend = "nccl" if device == "cuda" and dist.is_nccl_available() else "gloo"
    if backend == "gloo" and device == "cuda":
        raise LessonError(
            "--backend gloo with --device cuda: gloo's send/recv cannot move CUDA tensors "
            "(https://pytorch.org/docs/stable/distributed.html#backends); use nccl on GPUs "
            "or --device cpu"
        )
    if backend == "nccl":
        if n_gpus == 0 or not dist.is_nccl_available():
            raise LessonError(
                "--backend nccl: NCCL needs CUDA GPUs and a CUDA build of PyTorch; "
                "use --backend gloo on CPU"
            )
        if device != "cuda":
            raise LessonError(
                "--backend nccl communicates CUDA tensors only; it cannot run with --device cpu"
            )
    torch_device = torch.device(f"cuda:{local_rank}") if device == "cuda" else torch.device("cpu")
    return backend, torch_device
