"""Sharded checkpoints with `torch.distributed.checkpoint` (DCP), with a completion marker (lesson 13).

Every rank writes its own shard files (`__R_0.distcp`) and the coordinator writes `.metadata`; a checkpoint saved
by N ranks loads on M ranks because DCP records which slice of which tensor each file holds and each loading rank
reads the slices its own shards need (https://pytorch.org/docs/stable/distributed.checkpoint.html).

A crash can leave some of those files written and some not. So the save removes any old marker first, and rank 0
writes `COMPLETE.json` (the model's parameter names and shapes, the world size, the step) last, after a barrier
that every rank reaches only when its files are written; a loader refuses a folder without it, or one whose
shapes are not this model's, before any process group exists: every rank fails alike, with one line.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from common.harness.atomic import atomic_write
from common.harness.env import DistInfo, LessonError

__all__ = [
    "MARKER",
    "FULL_MODEL",
    "agreed_folder",
    "check_complete",
    "save_sharded",
    "mark_complete",
    "load_sharded",
]

MARKER = "COMPLETE.json"
FULL_MODEL = "full_model.pt"  # the whole model in one file, for a single-process reader


def check_complete(path: str | Path, signature: dict[str, list[int]]) -> dict:
    """The marker of a complete checkpoint of this model, or LessonError saying what is wrong (call it on every
    rank before any process group: each reads the same file and fails alike)."""
    path = Path(path)
    if not path.is_dir():
        raise LessonError(f"no sharded checkpoint at {path} (not a folder)")
    if not (path / MARKER).is_file():
        raise LessonError(
            f"{path} has no {MARKER}: its save did not finish (or it is not a checkpoint of this "
            "lesson); refusing to load a partial checkpoint"
        )
    try:
        marker = json.loads((path / MARKER).read_text())
        theirs = marker["model"]
    except (ValueError, KeyError) as e:
        raise LessonError(
            f"{path / MARKER} is not a completion marker ({type(e).__name__})"
        ) from None
    if theirs != signature:
        diff = sorted(set(theirs) ^ set(signature)) or [
            k for k in signature if theirs[k] != signature[k]
        ]
        k = diff[0]
        raise LessonError(
            f"{path} holds a checkpoint of another model: {k} is {theirs.get(k, 'absent')} there, "
            f"{signature.get(k, 'absent')} here (--width/--depth must match the saving run)"
        )
    return marker


def save_sharded(
    model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path, info: DistInfo
) -> None:
    """Every rank saves its shards of the model and the optimizer state; rank 0 also writes the full model
    (gathered to rank 0 on the CPU: `full_state_dict=True, cpu_offload=True`) as `full_model.pt`.
    Call `mark_complete` after everything that belongs to the checkpoint is written."""
    path = Path(path)
    if info.master_process:
        path.mkdir(parents=True, exist_ok=True)
        (path / MARKER).unlink(
            missing_ok=True
        )  # an old marker must not vouch for the files written now
    dist.barrier()
    model_sd, optim_sd = get_state_dict(
        model, optimizer
    )  # DTensors: this rank's shards, keyed by name
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if (
        info.master_process
    ):  # the other ranks got {}: the full tensors exist on rank 0 only, on the CPU
        atomic_write(path / FULL_MODEL, lambda f: torch.save(full, f))


def mark_complete(path: str | Path, info: DistInfo, **facts) -> None:
    """After a barrier (every rank's files are written), rank 0 writes the marker, atomically, last."""
    dist.barrier()
    if info.master_process:
        atomic_write(Path(path) / MARKER, lambda f: f.write(json.dumps(facts, indent=1).encode()))
    dist.barrier()


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """Load a checkpoint saved by any number of ranks into this (sharded) model and optimizer, in place: DCP reads
    into the state dict's own DTensors, each rank the slices of its shards."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def agreed_folder(path: str | Path | None, info: DistInfo) -> Path:
    """`path`, or (None) a temporary folder rank 0 makes: broadcast, so that every rank uses the same one."""
    folder = [path or (tempfile.mkdtemp() if info.master_process else None)]
    dist.broadcast_object_list(folder)
    return Path(folder[0])
