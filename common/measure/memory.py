"""The memory of a training step, measured from tensors (lessons 07 and 08, benchmarks/memory_speed.py).

- `ResidualMLP`: the model of lessons 07 and 08 (no BatchNorm, so micro-batches add up exactly), with optional
  activation checkpointing per block.
- `storage_bytes(tensors)`: bytes of the storages behind some tensors, each storage counted once (a view or a
  second reference to the same memory adds nothing), which is what the memory really holds.
- `saved_activation_bytes(model, run)`: what autograd keeps for backward during one forward, parameters excluded.
- `residual_mlp_activation_bytes(...)`: the same number from the shapes, to check the measurement exactly.
- Gradient accumulation, the first memory saving (k micro-batches hold about 1/k of the activations):
  `no_sync_unless(model, last)` and `micro_batch_stream(...)`, the pieces of lesson 07's loop that lesson 08 reuses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from common.measure.counters import saved_tensor_bytes
from common.models import mlp

__all__ = [
    "ResidualMLP",
    "storage_bytes",
    "saved_activation_bytes",
    "residual_mlp_activation_bytes",
    "no_sync_unless",
    "micro_batch_stream",
]


class ResidualMLP(nn.Module):
    """A stack of residual GELU MLP blocks for flattened 8x8 digits; no BatchNorm.

    Shapes: x (B, 1, 8, 8) or (B, 64) -> logits (B, 10).

        stem   Linear(64 -> w)                                  (B, w)
        block  h + Linear(w -> w) . GELU . Linear(w -> w) (h)    (B, w), `depth` times (common.models.mlp)
        head   GELU . Linear(w -> 10)                            (B, 10)

    Why no BatchNorm: BatchNorm normalises each micro-batch with its own mean and variance, so k micro-batches
    of 2 are not the same computation as one batch of 16 and accumulation could not equal the global step
    (lesson 06). LayerNorm would be fine (per sample); plain residual blocks keep the model small.

    With `checkpointing = True` each block runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`
    (https://pytorch.org/docs/stable/checkpoint.html): autograd keeps only the block's input and recomputes
    the block's forward during backward. Per block that keeps 1 tensor of (B, w) instead of 3 (the first
    Linear's input, the GELU's input and the second Linear's input).
    """

    def __init__(
        self, width: int = 256, depth: int = 4, in_features: int = 64, num_classes: int = 10
    ):
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(
            mlp([width, width, width], activation=nn.GELU) for _ in range(depth)
        )
        self.head = nn.Sequential(nn.GELU(), nn.Linear(width, num_classes))
        self.checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x.flatten(1))  # (B, w)
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                # Keeps only `h` (B, w) for backward; the block's inner tensors are recomputed during backward.
                h = h + checkpoint(block, h, use_reentrant=False)
            else:
                h = h + block(h)
        return self.head(h)


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the storages behind `tensors`, each storage counted once (None entries are skipped).

    `t.untyped_storage().nbytes()` is the memory a tensor's data lives in; a view (`x.flatten(1)`, a slice)
    shares its base's storage, so summing `numel() * element_size()` over views would count memory twice.
    """
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        key = (t.untyped_storage().data_ptr(), str(t.device))
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def saved_activation_bytes(model: nn.Module, run: Callable[[], object]) -> int:
    """Bytes autograd keeps for backward while `run()` executes one forward, parameters excluded.

    `common.measure.counters.saved_tensor_bytes` counts every saved storage once; a Linear saves its weight, which is
    memory that exists anyway, so parameters are excluded. Under autocast the low-precision weight copies
    autocast makes ARE counted: they live until backward. A checkpointed block (use_reentrant=False) saves its
    input through the same hooks, so the count includes it; the tensors it recomputes in backward are not saved.
    """
    with saved_tensor_bytes(exclude=model.parameters()) as saved:
        out = run()
    del out
    return saved.bytes


def residual_mlp_activation_bytes(
    batch: int,
    width: int,
    depth: int,
    checkpointing: bool = False,
    in_features: int = 64,
    element_size: int = 4,
) -> int:
    """What `saved_activation_bytes` must measure for one fp32 forward of `ResidualMLP`, from the shapes.

    Plain: the stem saves its input (B, 64); each block saves 3 tensors of (B, w) (the first Linear's input, the
    GELU's input, the second Linear's input); the head saves 2 (the GELU's input and the Linear's input):
        element_size x B x (64 + w x (3 x depth + 2)).
    Checkpointing keeps 1 tensor (B, w) per block instead of 3: element_size x B x (64 + w x (depth + 2)).
    The saving, 1 - (64 + w(d + 2)) / (64 + w(3d + 2)), does not depend on the batch.
    """
    per_block = 1 if checkpointing else 3
    return element_size * batch * (in_features + width * (per_block * depth + 2))


def no_sync_unless(model: nn.Module, last: bool):
    """`model.no_sync()` on every micro-step but the last under DDP; nothing to skip without DDP.

    Use it around the forward AND the backward: DDP arms its reducer in the forward (lesson 07 counts it).
    """
    return model.no_sync() if isinstance(model, DDP) and not last else nullcontext()


def micro_batch_stream(
    dataset: Dataset, micro_batch: int, world_size: int, rank: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Rank `rank`'s micro-batches of `micro_batch` samples, forever: its `DistributedSampler` shard, reshuffled
    at each pass by `set_epoch(epoch)`, the last incomplete micro-batch dropped (so every micro-batch has the
    same size and k of them average to the mean over k x micro_batch samples)."""
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed
    )
    loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1
