"""Atomic checkpoints written by global rank 0 (introduced in lesson 01, made rank-aware in 03).

A checkpoint is written to a temporary file in the same folder and renamed over the target with `os.replace`,
which is atomic on POSIX: a crash mid-write leaves the previous checkpoint intact, never half a file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common.harness.env import DistInfo, LessonError
from common.harness.session import rank0_only

__all__ = ["atomic_write", "save_checkpoint", "load_checkpoint"]


def atomic_write(path: str | Path, write: Callable[[Any], None]) -> Path:
    """Call `write(file_object)` on a temporary file beside `path`, fsync it, then rename it onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_checkpoint(state: dict, path: str | Path, info: DistInfo) -> bool:
    """Global rank 0 writes `state` atomically; every rank waits until the file is complete.

    Only RANK 0 writes: on two nodes LOCAL_RANK 0 exists twice, and two writers to a shared file system race.
    The others wait in `rank0_only`, not in a barrier bounded by --timeout-s: a large checkpoint on a slow file
    system may take longer than a collective is allowed to, and the waiting ranks must not time out meanwhile.
    Save the unwrapped model (`raw_model.state_dict()`, not the DDP wrapper's `module.`-prefixed keys).

    Returns:
        True on the rank that wrote the file.
    """
    with rank0_only(info, "writing the checkpoint") as mine:
        if mine:
            atomic_write(path, lambda f: torch.save(state, f))
    return info.master_process


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu") -> dict:
    """Load a checkpoint onto `device` with `weights_only=True` (tensors and plain containers only).

    `map_location` puts every tensor on this rank's device: without it, tensors saved from cuda:0 would all
    land on cuda:0 on every rank (https://pytorch.org/docs/stable/generated/torch.load.html).

    Raises:
        LessonError: the file does not exist or is not a checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise LessonError(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise LessonError(f"cannot load checkpoint {path} ({type(e).__name__})") from None
