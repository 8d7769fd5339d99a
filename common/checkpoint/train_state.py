"""The whole training state in one checkpoint, written so that a crash never leaves a file that loads (lesson 16).

Resuming "exactly" means the resumed run computes the same bits as a run that never stopped. That needs more
than the model: the optimizer's moments, the LR scheduler's position, the GradScaler's scale, every random
stream a step draws from (torch, numpy, `random`, per-rank `torch.Generator`s, CUDA) on EVERY rank, and where
the sampler is: its epoch AND how many samples of that epoch were already trained.
The random streams are captured by common/checkpoint/rng_state.py.

    step_000008.pt     torch.save of the state, written by global rank 0 through `common.harness.atomic.atomic_write`
    step_000008.json   the completion marker, written after the .pt is renamed: step, sha256 and size of the .pt,
                       world size, the model's parameter names and shapes

A checkpoint counts only when its marker exists AND the .pt's sha256 matches it: a kill mid-write leaves a
`.step_000008.pt.XXXX.tmp` (never renamed), a kill between rename and marker leaves a .pt without a marker, and
neither is ever loaded; the previous complete checkpoint is (`find_latest`).
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DistributedSampler

from common.harness.atomic import atomic_write, load_checkpoint
from common.harness.env import DistInfo, LessonError
from common.harness.session import rank0_only
from common.measure.differences import max_abs_diff_all, max_over_ranks

__all__ = [
    "ResumableDistributedSampler",
    "model_signature",
    "save_train_state",
    "find_latest",
    "load_train_state",
    "check_same_run",
    "leftovers",
    "resume_point",
    "clear_run",
    "roundtrip",
    "max_diff_over_ranks",
]


class ResumableDistributedSampler(DistributedSampler):
    """`DistributedSampler` that remembers how far into the epoch training got, and restarts there.

    `seen` counts GLOBAL samples trained in this epoch (all ranks together). Rank r's list for the epoch is
    perm[r::W] (the same permutation on every rank, seeded by seed + epoch); `__iter__` starts it at seen / W,
    so a resumed run skips the trained samples without reading them (it slices indices, not data). Because
    the list is perm[r::W], the global batch of step t with per-rank batch b is perm[t*G : (t+1)*G], G = W*b:
    the same samples for any world size that keeps G (lesson 16, a world that changes size).
    torchdata's `StatefulDataLoader` keeps the same position for a DataLoader with workers.
    """

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int, samples_per_epoch: int):
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        if samples_per_epoch % num_replicas or samples_per_epoch > len(dataset):
            raise LessonError(
                f"{samples_per_epoch} samples per epoch cannot be split over {num_replicas} ranks"
            )
        self.samples_per_epoch, self.seen = (
            samples_per_epoch,
            0,
        )  # global samples used per epoch / trained so far

    def __iter__(self):
        mine = list(super().__iter__())[: self.samples_per_epoch // self.num_replicas]
        return iter(mine[self.seen // self.num_replicas :])

    def __len__(self) -> int:
        return (self.samples_per_epoch - self.seen) // self.num_replicas

    def advance(self, global_samples: int) -> None:
        """After an optimizer step on `global_samples` samples; rolls over to the next epoch at its end."""
        self.seen += global_samples
        if self.seen >= self.samples_per_epoch:
            self.set_epoch(self.epoch + 1)
            self.seen = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        if state["seen"] % self.num_replicas or state["seen"] >= self.samples_per_epoch:
            raise LessonError(
                f"sampler position {state['seen']} does not fit {self.num_replicas} ranks"
            )
        self.set_epoch(state["epoch"])
        self.seen = state["seen"]


def model_signature(model: nn.Module) -> dict[str, list[int]]:
    """{name: shape} of every tensor in the model's state dict: what a checkpoint must match to load into it."""
    return {name: list(t.shape) for name, t in model.state_dict().items()}


def _paths(ckpt_dir: Path, step: int) -> tuple[Path, Path]:
    return ckpt_dir / f"step_{step:06d}.pt", ckpt_dir / f"step_{step:06d}.json"


def save_train_state(
    state: dict,
    ckpt_dir: str | Path,
    step: int,
    info: DistInfo,
    signature: dict,
    keep: int = 2,
    fault: Callable[[str, object, bytes], None] | None = None,
) -> Path:
    """Global rank 0 writes `state` (with every rank's RNG already gathered into it) and its marker; all wait.

    Order: serialize -> atomic_write the .pt (temp file, fsync, rename) -> atomic_write the marker -> delete
    all but the newest `keep` complete checkpoints. The other ranks wait in `rank0_only` (as
    `common.harness.atomic.save_checkpoint` does), not in a barrier bounded by --timeout-s: a big checkpoint on a
    slow file system may take longer than a collective may, and nobody may train on before it is complete.
    If the writer dies instead, the waiting ranks' barrier raises (gloo) and torchrun restarts the job.
    `fault(point, file, payload)` is called at "mid-write" and "before-rename" (lesson 16 kills the writer
    there); None in normal use.
    """
    ckpt_dir = Path(ckpt_dir)
    pt, marker = _paths(ckpt_dir, step)
    with rank0_only(info, "writing the checkpoint") as mine:
        if mine:
            _write(state, ckpt_dir, step, info, signature, keep, fault)
    return pt


def _write(
    state: dict, ckpt_dir: Path, step: int, info: DistInfo, signature: dict, keep: int, fault
) -> None:
    pt, marker = _paths(ckpt_dir, step)
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()

    def write(f) -> None:
        if fault:
            f.write(payload[: len(payload) // 2])
            fault("mid-write", f, payload)
        f.write(payload[len(payload) // 2 :] if fault else payload)
        if fault:
            fault("before-rename", f, payload)

    atomic_write(pt, write)
    meta = {
        "step": step,
        "sha256": hashlib.sha256(payload).hexdigest(),
        "bytes": len(payload),
        "world_size": info.world_size,
        "model": signature,
    }
    atomic_write(marker, lambda f: f.write(json.dumps(meta).encode()))  # the commit point
    for old in sorted(ckpt_dir.glob("step_*.json"))[:-keep]:
        old.unlink()
        old.with_suffix(".pt").unlink(missing_ok=True)


def _complete(marker: Path) -> dict | None:
    """The marker's contents when its .pt exists with the recorded sha256; None otherwise."""
    try:
        meta = json.loads(marker.read_text())
        data = marker.with_suffix(".pt").read_bytes()
    except (OSError, ValueError):
        return None
    return meta if hashlib.sha256(data).hexdigest() == meta.get("sha256") else None


def find_latest(ckpt_dir: str | Path) -> tuple[Path, dict] | None:
    """(path of the newest COMPLETE checkpoint, its marker), or None when there is none."""
    ckpt_dir = Path(ckpt_dir)
    for marker in sorted(ckpt_dir.glob("step_*.json"), reverse=True):
        meta = _complete(marker)
        if meta is not None:
            return marker.with_suffix(".pt"), meta
    return None


def leftovers(ckpt_dir: str | Path, remove: bool = False) -> list[str]:
    """Files a killed save left behind, never loaded: temp files and .pt files without a valid marker (removed
    when `remove`)."""
    ckpt_dir = Path(ckpt_dir)
    tmp = [p for p in ckpt_dir.glob(".step_*.tmp")]
    unmarked = [p for p in ckpt_dir.glob("step_*.pt") if _complete(p.with_suffix(".json")) is None]
    for p in tmp + unmarked if remove else []:
        p.unlink(missing_ok=True)
    return sorted(p.name for p in tmp + unmarked)


def check_same_run(meta: dict, signature: dict, world_size: int, path: Path) -> None:
    """Refuse a checkpoint of another model, or one written by another world size (exact resume needs the same
    per-rank RNG streams and per-rank sample lists). Raises LessonError with one line."""
    if meta["model"] != signature:
        k = sorted(set(meta["model"]) ^ set(signature)) or [
            k for k in signature if meta["model"][k] != signature[k]
        ]
        raise LessonError(
            f"{path} is a checkpoint of another model: {k[0]} is {meta['model'].get(k[0], 'absent')} "
            f"there, {signature.get(k[0], 'absent')} here (--width must match the saving run)"
        )
    if meta["world_size"] != world_size:
        raise LessonError(
            f"{path} was written by {meta['world_size']} ranks and exact resume needs the same "
            f"world size (one RNG stream and one sample list per rank), not {world_size}; "
            "continue on another world size from a sharded checkpoint (--resume-sharded)"
        )


def resume_point(
    ckpt_dir: str | Path, required: bool, signature: dict, world_size: int
) -> tuple[Path, dict] | None:
    """`find_latest`, checked with `check_same_run`; LessonError when `required` (--resume) and there is none."""
    found = find_latest(ckpt_dir)
    if found is None and required:
        raise LessonError(
            f"--resume: no complete checkpoint in {ckpt_dir} (set --ckpt-dir to the saving run's)"
        )
    if found:
        check_same_run(found[1], signature, world_size, found[0])
    return found


def load_train_state(path: str | Path, device: torch.device) -> dict:
    """`common.harness.atomic.load_checkpoint` (weights_only=True, tensors onto this rank's device)."""
    return load_checkpoint(path, device)


def clear_run(ckpt_dir: str | Path) -> None:
    """Forget a previous run's full checkpoints, leftovers and events in `ckpt_dir` (sharded folders stay)."""
    ckpt_dir = Path(ckpt_dir)
    for f in [*ckpt_dir.glob("step_*"), *ckpt_dir.glob(".step_*"), ckpt_dir / "events.jsonl"]:
        f.unlink(missing_ok=True)


def roundtrip(state: dict) -> dict:
    """`state` through torch.save and `torch.load(weights_only=True)`: what a resumed run reads from the file."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def max_diff_over_ranks(model: nn.Module, params, info: DistInfo) -> float:
    """max |p - q| over the model's parameters and `params` (same order), maximised over ranks; NaN if any is."""
    return max_over_ranks(
        max_abs_diff_all(model.parameters(), params)
    )  # no process group: this rank's
