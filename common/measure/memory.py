"""The memory of a training step, measured from tensors (lessons 07 and 08, benchmarks/memory_speed.py).

- `storage_bytes(tensors)`: bytes of the storages behind some tensors, each storage counted once (a view or a
  second reference to the same memory adds nothing), which is what the memory really holds.
- `held_bytes(params, grads, optimizer)`: the parameters, gradients and optimizer state a rank holds (lessons 08,
  13, 21).
- `saved_bytes(exclude)`: THE measurement of what autograd saves for backward inside a `with` block, through
  `torch.autograd.graph.saved_tensors_hooks` (https://pytorch.org/docs/stable/autograd.html#saved-tensors-hooks):
  the same count on CPU and CUDA, a DTensor by its local shard. Every lesson that counts saved bytes uses it.
- `saved_activation_bytes(model, run)`: `saved_bytes` around one forward, the model's parameters excluded;
  `saved_bytes_of(fn, tensors)`: around `fn` on fresh leaf copies of `tensors` (lesson 19's attention).
- `residual_mlp_activation_bytes(...)`: the same number from the shapes, to check the measurement exactly.

The model these count, `ResidualMLP`, is in common/models.py; the micro-batches of gradient accumulation, the
first memory saving, in common/data_parallel/micro_batches.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from common.measure.counters import local_shard

__all__ = [
    "storage_key",
    "storage_bytes",
    "held_bytes",
    "SavedBytes",
    "saved_bytes",
    "saved_activation_bytes",
    "saved_bytes_of",
    "residual_mlp_activation_bytes",
]


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


def saved_bytes_of(fn: Callable, tensors: Iterable[torch.Tensor]) -> int:
    """Bytes autograd saves for backward when `fn(*leaves)` runs on copies of `tensors` that require grad
    (`saved_bytes`, each storage once): what an operation such as attention keeps, its inputs included."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    with saved_bytes() as saved:
        fn(*leaves)
    return saved.bytes


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
