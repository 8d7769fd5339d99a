"""A checkpoint that a different number of ranks can load: torch.distributed.checkpoint (DCP) for a DDP run
(lesson 16; lesson 13 does the same for FSDP2, whose tensors are themselves sharded).

`dcp.save` has every rank write a `__R_0.distcp` file and the coordinator a `.metadata` that says which
slice of which tensor each file holds; a DDP model is replicated, so DCP writes each tensor once (it
de-duplicates replicas across ranks) and any world size can read it back
(https://pytorch.org/docs/stable/distributed.checkpoint.html). What DCP does not know is the training loop:
rank 0 writes that (step, sampler position, scheduler, global batch, the parameters to compare at the switch)
into `COMPLETE.pt` LAST, after a barrier every rank reaches with its files written: a folder without it is an
unfinished save and is refused.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from common.checkpoint.sharded import load_sharded
from common.checkpoint.train_state import model_signature
from common.harness.atomic import atomic_write, load_checkpoint
from common.harness.env import DistInfo, LessonError

__all__ = ["MARKER", "save_reshardable", "check_sharded", "load_resharded", "micro_steps_for"]

MARKER = "COMPLETE.pt"


def save_reshardable(
    model: nn.Module, optimizer, path: str | Path, info: DistInfo, meta: dict
) -> dict:
    """Every rank: DCP-save model + optimizer to `path`; then rank 0 writes the completion marker: `meta` (the
    loop's state) + the model's signature, the world size and the parameters (to compare at the switch).

    Also saves the same state once more with `dcp.async_save` (into path + "_async", deleted afterwards) to
    measure what each costs the training loop. Returns {"sync_s", "async_block_s", "bytes"}: seconds the
    loop was blocked by `dcp.save`, by `dcp.async_save` (it returns once the state is staged; the write goes
    on in a thread), and the bytes of the .distcp files.
    """
    path = Path(path)
    model_sd, optim_sd = get_state_dict(
        model, optimizer
    )  # plain names (no DDP "module."), optimizer by name
    t0 = time.perf_counter()
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    sync_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    future = dcp.async_save(
        {"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path) + "_async"
    )
    async_block_s = time.perf_counter() - t0
    future.result()  # a real loop would train on and check it before the next save
    if info.distributed:
        dist.barrier()  # every rank's files are written
    if info.master_process:
        meta = {
            **meta,
            "model": model_signature(model),
            "world_size": info.world_size,
            "params": [p.detach().cpu() for p in model.parameters()],
        }
        atomic_write(path / MARKER, lambda f: torch.save(meta, f))
        for f in Path(str(path) + "_async").iterdir():
            f.unlink()
        Path(str(path) + "_async").rmdir()
    if info.distributed:
        dist.barrier()
    return {
        "sync_s": sync_s,
        "async_block_s": async_block_s,
        "bytes": sum(f.stat().st_size for f in path.glob("*.distcp")),
    }


def check_sharded(path: str | Path, signature: dict) -> dict:
    """The marker of a complete DCP checkpoint of this model; LessonError (one line) otherwise. Call it on every
    rank before any process group: each reads the same file and fails alike."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise LessonError(
            f"{path} has no {MARKER}: not a sharded checkpoint, or its save did not finish"
        )
    meta = load_checkpoint(path / MARKER)
    if meta.get("model") != signature:
        raise LessonError(
            f"{path} is a checkpoint of another model (--width must match the saving run)"
        )
    return meta


def load_resharded(
    model: nn.Module, optimizer, path: str | Path, meta: dict, scheduler, sampler
) -> int:
    """Every rank: fill model and optimizer from a DCP checkpoint written by any number of ranks, the scheduler
    and the sampler from its marker `meta`; returns the step it was saved at."""
    load_sharded(model, optimizer, path)  # each rank reads the slices its tensors need
    scheduler.load_state_dict(meta["scheduler"])
    sampler.load_state_dict(
        meta["sampler"]
    )  # global samples seen in the epoch: a position for any world size
    return meta["step"]


def micro_steps_for(meta: dict, world_size: int, batch_size: int, keep_global_batch: bool) -> int:
    """Micro-steps per optimizer step on the new world: 1, or old global batch / (world_size x batch_size) to keep
    the global batch. LessonError when that is not a whole number, or when the epoch position saved (global
    samples) is not a whole number of the new global batches."""
    k, rest = divmod(meta["global_batch"], world_size * batch_size) if keep_global_batch else (1, 0)
    if rest or k < 1:
        raise LessonError(
            f"cannot reshard keeping the global batch: {meta['global_batch']} samples per step over "
            f"{world_size} ranks x --batch-size {batch_size} is not a whole number of micro-steps"
        )
    if meta["sampler"]["seen"] % (k * world_size * batch_size):
        raise LessonError(
            f"the sharded checkpoint stopped {meta['sampler']['seen']} samples into an epoch: not a "
            f"whole number of this run's global batches ({k * world_size * batch_size})"
        )
    return k
