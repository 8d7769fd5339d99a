"""The memory of a training step, measured from tensors (lessons 07 and 08, benchmarks/memory_speed.py).

- `ResidualMLP`: the model of lessons 07 and 08 (no BatchNorm, so micro-batches add up exactly), with optional
  activation checkpointing per block.
- `storage_bytes(tensors)`: bytes of the storages behind some tensors, each storage counted once (a view or a
  second reference to the same memory adds nothing), which is what the memory really holds.
- `held_bytes(params, grads, optimizer)`: the parameters, gradients and optimizer state a rank holds (lessons 08,
  13, 21).
- `saved_bytes(exclude)`: THE measurement of what autograd saves for backward inside a `with` block, through
  `torch.autograd.graph.saved_tensors_hooks` (https://pytorch.org/docs/stable/autograd.html#saved-tensors-hooks):
  the same count on CPU and CUDA, a DTensor by its local shard. Every lesson that counts saved bytes uses it.
- `saved_activation_bytes(model, run)`: `saved_bytes` around one forward, the model's parameters excluded.
- `residual_mlp_activation_bytes(...)`: the same number from the shapes, to check the measurement exactly.
- `CountingScaler`: a GradScaler that counts its unscale_/step/update calls.
- Gradient accumulation, the first memory saving (k micro-batches hold about 1/k of the activations):
  `no_sync_unless(model, last)` and `micro_batch_stream(...)`, the pieces of lesson 07's loop that lesson 08 reuses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from common.measure.counters import local_shard
from common.models import mlp

__all__ = [
    "ResidualMLP",
    "storage_key",
    "storage_bytes",
    "held_bytes",
    "SavedBytes",
    "saved_bytes",
    "saved_activation_bytes",
    "residual_mlp_activation_bytes",
    "CountingScaler",
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

    def bf16_weight_copy_bytes(self) -> int:
        """Bytes of the bf16 weight copies autocast keeps for backward: it saves a Linear's weight when backward
        needs it for the input's gradient, so every Linear but the stem, whose input x needs none; 2 bytes each."""
        return 2 * sum(
            p.numel()
            for n, p in self.named_parameters()
            if n.endswith("weight") and n[:4] != "stem"
        )

    def activation_bytes(self, x: torch.Tensor, checkpointing: bool = False) -> int:
        """`saved_activation_bytes` of one forward of a copy of `x`, with or without checkpointing, under the
        caller's autocast. A copy: a slice x[:b] is a view that keeps (and would count) all of x's storage."""
        before, self.checkpointing = self.checkpointing, checkpointing
        try:
            return saved_activation_bytes(self, lambda: self(x.clone()))
        finally:
            self.checkpointing = before


def _holder(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds `t`'s data on this rank: a DTensor's local shard, the tensor an
    AsyncCollectiveTensor (a functional collective's result not yet waited for) wraps, else `t`."""
    t = local_shard(t)
    return getattr(t, "elem", t) if type(t).__name__ == "AsyncCollectiveTensor" else t


def storage_key(t: torch.Tensor) -> tuple[tuple, int]:
    """(a key naming the memory behind `t`, the bytes of that memory): a view shares its base's key.

    A DTensor counts its local shard (what this rank stores), a functional collective's result not yet waited
    for (AsyncCollectiveTensor) the tensor it wraps; a tensor with no real storage behind it (a wrapper subclass,
    seen at batch size 1 under tensor parallelism) counts itself, numel x element size.
    """
    t = _holder(t)
    try:
        storage = t.untyped_storage()
        return (storage.data_ptr(), str(t.device), storage.nbytes()), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return (id(t), str(t.device), -1), t.numel() * t.element_size()


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the storages behind `tensors`, each storage counted once (None entries are skipped).

    `t.untyped_storage().nbytes()` is the memory a tensor's data lives in; a view (`x.flatten(1)`, a slice)
    shares its base's storage, so summing `numel() * element_size()` over views would count memory twice.
    """
    sizes = dict(storage_key(t) for t in tensors if t is not None)
    return sum(sizes.values())


def held_bytes(
    params: Iterable[torch.Tensor],
    grads: Iterable[torch.Tensor | None],
    optimizer: torch.optim.Optimizer,
    together: bool = False,
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds, each storage counted once.

    Call it after `optimizer.step()` and before `zero_grad`, when all three exist. For Adam the state is
    exp_avg and exp_avg_sq (one fp32 tensor per parameter each) and a 0-d fp32 `step` per parameter tensor.
    A DTensor (FSDP2) counts its local shard; ZeRO stage-3 flat buffers between uses are 0-byte storages.
    With `together`, also `all_three_counted_together`: their sum when no storage is shared.
    """
    params, grads = list(params), [g for g in grads if g is not None]
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    held = {
        "parameters": storage_bytes(params),
        "gradients": storage_bytes(grads),
        "optimizer_state": storage_bytes(state),
    }
    if together:
        held["all_three_counted_together"] = storage_bytes([*params, *grads, *state])
    return held


@dataclass
class SavedBytes:
    """What autograd saved for backward while `saved_bytes` was counting.

    Attributes:
        bytes: the bytes saved, each storage once (or, with `views=True`, each view's own bytes once).
        tensors: how many distinct storages (or views) those bytes came from.
        storages: every saved storage that was not excluded, kept so that `held_now` can read its size later.
    """

    bytes: int = 0
    tensors: int = 0
    storages: list = field(default_factory=list, repr=False)
    _seen: set = field(default_factory=set, repr=False)

    def held_now(self) -> int:
        """Bytes the saved storages hold NOW, each once: after a forward that freed some of them (a ZeRO-3 unit
        or an FSDP2 module that reshards after forward resizes its gathered weights to 0 bytes), less than
        `bytes`."""
        sizes = {}
        for s in self.storages:
            if s.nbytes() > 0:
                sizes[(s.data_ptr(), str(s.device))] = s.nbytes()
        return sum(sizes.values())


@contextmanager
def saved_bytes(
    exclude: Iterable[torch.Tensor] = (), *, views: bool = False
) -> Iterator[SavedBytes]:
    """Count what autograd saves for backward inside this block.

    Args:
        exclude: tensors not to count, typically `model.parameters()`: a Linear saves its weight for backward,
            which is memory that exists anyway, not an activation. A view of one is excluded too.
        views: count each saved view's own bytes (numel x element size, once per address, shape and stride)
            instead of its whole storage: a pipeline's micro-batch is a view into the batch, and a stage holds
            its rows, not the batch's (`common.pipeline.executor`). Default: each storage once, what memory holds.

        with saved_bytes(exclude=model.parameters()) as saved:
            loss = model(x).sum()
        print(saved.bytes)

    Under autocast the low-precision weight copies autocast makes ARE counted: they live until backward. A
    checkpointed block (use_reentrant=False) saves its input through the same hooks; the tensors it recomputes in
    backward are not saved.
    """
    counter = SavedBytes()
    skip = {storage_key(t)[0] for t in exclude}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key, nbytes = storage_key(t)
        if key in skip:
            return t
        held = _holder(t)
        if key[2] >= 0:  # a real storage: keep it, so that `held_now` can read its size later
            counter.storages.append(held.untyped_storage())
            if views:
                key = (held.data_ptr(), tuple(held.shape), tuple(held.stride()))
                nbytes = held.numel() * held.element_size()
        if key not in counter._seen:
            counter._seen.add(key)
            counter.bytes += nbytes
            counter.tensors += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield counter


def saved_activation_bytes(model: nn.Module, run: Callable[[], object]) -> int:
    """Bytes autograd keeps for backward while `run()` executes one forward, `model`'s parameters excluded
    (`saved_bytes`, each storage once)."""
    with saved_bytes(exclude=model.parameters()) as saved:
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


class CountingScaler(torch.amp.GradScaler):
    """A GradScaler that counts its unscale_/step/update calls: under accumulation each must run once per
    optimizer step, after the last micro-step (lesson 08 claims it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.counts = {"unscale_": 0, "step": 0, "update": 0}

    def unscale_(self, optimizer):
        self.counts["unscale_"] += 1
        return super().unscale_(optimizer)

    def step(self, optimizer, *args, **kwargs):
        self.counts["step"] += 1
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None):
        self.counts["update"] += 1
        return super().update(new_scale)


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
