"""Sharded checkpoints with `torch.distributed.checkpoint` (DCP), any world size, one completion marker (lesson 15).

Every rank writes the chunks it holds (`__R_0.distcp`: an FSDP2 rank its shards; replicated DDP tensors are
written once, DCP spreading them over the ranks) and the coordinator writes `.metadata`: which chunk of which
tensor sits where in which file. A checkpoint saved by N ranks loads on M because each loading rank reads, from
whichever files hold them, the chunks that overlap its own shards
(https://pytorch.org/docs/stable/distributed.checkpoint.html).

The rules that never lose a checkpoint:
1. every save goes to its step's own folder (`step_folder`); saving into a folder that has a marker removes the
   marker first, so a half-rewritten folder never passes for complete;
2. every rank's files first, then a barrier, then rank 0 writes `COMPLETE.json` LAST, atomically (a temporary
   file, fsync, `os.replace`: `common.harness.atomic.atomic_write`);
3. a loader takes the newest folder that has a marker (`latest_complete`) and refuses one without it
   (`check_complete`, on every rank before any process group: every rank fails alike, with one line);
4. nothing here deletes an older checkpoint: a caller that keeps only the last k deletes one only after a newer
   one is complete.
A save killed half-way leaves files without a marker beside the last complete checkpoint, which still loads.
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
    "step_folder",
    "check_complete",
    "check_world_size_can_continue",
    "latest_complete",
    "save_sharded",
    "async_save_sharded",
    "mark_complete",
    "load_sharded",
    "chunks_written",
    "bytes_by_rank",
    "agreed_folder",
]

MARKER = "COMPLETE.json"
FULL_MODEL = "full_model.pt"  # the whole model in one file, for a single-process reader


def step_folder(root: str | Path, step: int) -> Path:
    """The folder of the checkpoint taken after `step` optimizer steps: root/step_000008."""
    return Path(root) / f"step_{step:06d}"


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


def check_world_size_can_continue(marker: dict, path: str | Path, world_size: int) -> None:
    """DCP loads on any world size; continuing the SAME run needs the saved global batch split evenly over the
    new ranks (each rank takes global_batch / world_size samples of every step). LessonError otherwise."""
    global_batch = marker.get("global_batch")
    if global_batch is not None and global_batch % world_size:
        raise LessonError(
            f"{path} was saved by {marker.get('world_size')} ranks with a global batch of {global_batch}: "
            f"{world_size} ranks cannot continue it (use a world size that divides {global_batch})"
        )


def latest_complete(root: str | Path, signature: dict[str, list[int]]) -> tuple[Path, dict]:
    """The newest step folder under `root` that has a marker, and its marker. Folders without a marker (a save
    that died) are passed over, never loaded; LessonError when no folder has one."""
    steps = Path(root).glob("step_[0-9]*")
    for folder in sorted(steps, key=lambda f: int(f.name.removeprefix("step_")), reverse=True):
        if (folder / MARKER).is_file():
            return folder, check_complete(folder, signature)
    raise LessonError(
        f"{root} holds no complete checkpoint: no step_* folder with a {MARKER} (every save there died "
        "before its marker, or it is not a checkpoint root)"
    )


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)  # DTensors: this rank's shards, by name
    return {"model": model_sd, "optim": optim_sd}


def save_sharded(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: str | Path,
    info: DistInfo,
    full_model: bool = True,
) -> None:
    """Every rank saves its shards of the model and of the optimizer state into `path`; with `full_model`,
    rank 0 also writes the whole model (gathered to rank 0 on the CPU: `full_state_dict=True,
    cpu_offload=True`) as `full_model.pt`. A folder already marked complete is rewritten only after its
    marker is removed (an old marker must not vouch for new files). Call `mark_complete` last."""
    path = Path(path)
    if info.master_process:
        path.mkdir(parents=True, exist_ok=True)
        (path / MARKER).unlink(missing_ok=True)
    dist.barrier()
    dcp.save(_state(model, optimizer), checkpoint_id=str(path))
    if full_model:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(
            model, options=options
        )  # {} off rank 0: the tensors are there only
        if info.master_process:
            atomic_write(path / FULL_MODEL, lambda f: torch.save(full, f))


def async_save_sharded(model: nn.Module, optimizer, path: str | Path, group):
    """`dcp.async_save` of model + optimizer: returns a Future once the state is staged (copied into CPU
    memory), the files are written by a thread. `group` is a gloo group of its own, so that the writer's
    collectives never interleave with the training loop's. Wait on the Future, then `mark_complete`."""
    Path(path).mkdir(parents=True, exist_ok=True)
    return dcp.async_save(_state(model, optimizer), checkpoint_id=str(path), process_group=group)


def mark_complete(path: str | Path, info: DistInfo, **facts) -> None:
    """After a barrier (every rank's files are written), rank 0 writes the marker, atomically, last."""
    dist.barrier()
    if info.master_process:
        atomic_write(Path(path) / MARKER, lambda f: f.write(json.dumps(facts, indent=1).encode()))
    dist.barrier()


def load_sharded(model: nn.Module, optimizer, path: str | Path, group=None) -> None:
    """Load a checkpoint saved by any number of ranks into this (sharded or replicated) model and optimizer, in
    place: DCP reads into the state dict's own tensors, each rank of `group` (default: the world) the chunks
    that overlap its shards."""
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path), process_group=group)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def chunks_written(path: str | Path) -> list[dict]:
    """Every tensor chunk in a DCP checkpoint, read from its `.metadata`: {"fqn", "offsets", "sizes", "shape"
    (the whole tensor's), "bytes" (elements x element size), "rank" (whose file holds it: __R_0.distcp)}. One
    process, no group needed."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    rows = []
    for index, where in metadata.storage_data.items():
        meta = metadata.state_dict_metadata[index.fqn]
        if not hasattr(meta, "chunks"):  # a non-tensor entry (an optimizer's param group settings)
            continue
        chunk = next(c for c in meta.chunks if list(c.offsets) == list(index.offset))
        element = torch.empty((), dtype=meta.properties.dtype).element_size()
        rows.append(
            {
                "fqn": index.fqn,
                "offsets": list(chunk.offsets),
                "sizes": list(chunk.sizes),
                "shape": list(meta.size),
                "bytes": chunk.sizes.numel() * element,
                "rank": int(where.relative_path.split("_")[2]),
            }
        )
    return rows


def bytes_by_rank(chunks: list[dict], world_size: int) -> list[int]:
    """The tensor bytes of `chunks_written` that each rank's file holds, rank 0 first."""
    return [sum(c["bytes"] for c in chunks if c["rank"] == k) for k in range(world_size)]


def agreed_folder(path: str | Path | None, info: DistInfo) -> Path:
    """`path`, or (None) a temporary folder rank 0 makes: broadcast, so that every rank uses the same one."""
    folder = [path or (tempfile.mkdtemp() if info.master_process else None)]
    dist.broadcast_object_list(folder)
    return Path(folder[0])
