"""Counters that make communication and activation memory visible without a GPU (lessons 06 and 07).

- `CommCounter`: a DDP communication hook that counts the all-reduce calls DDP makes (one per gradient bucket)
  and their bytes, then performs the same averaging all-reduce as DDP's default hook.
  (https://pytorch.org/docs/stable/ddp_comm_hooks.html)
- `saved_tensor_bytes`: counts the bytes autograd saves for backward inside a `with` block, through
  `torch.autograd.graph.saved_tensors_hooks` (https://pytorch.org/docs/stable/autograd.html#saved-tensors-hooks).
  Device-independent: the same count on CPU and CUDA, which is what activation checkpointing reduces.
"""
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

__all__ = ["CommCounter", "SavedBytes", "saved_tensor_bytes"]


@dataclass
class CommCounter:
    """Counts DDP's gradient all-reduces. Register with `ddp_model.register_comm_hook(counter, counter.hook)`.

    Attributes:
        calls: all-reduce calls (one per bucket per synchronised backward).
        bytes: bytes of gradient handed to those all-reduces (this rank's buffer sizes).
    """

    calls: int = 0
    bytes: int = 0

    def reset(self) -> None:
        self.calls = 0
        self.bytes = 0

    def register(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> "CommCounter":
        """Install this counter as `ddp_model`'s communication hook (once, before the first backward)."""
        ddp_model.register_comm_hook(self, CommCounter.hook)
        return self

    # No `from __future__ import annotations` in this module: DDP checks that the hook's annotations are the
    # real dist.GradBucket and torch.futures.Future classes, and would reject strings.
    @staticmethod
    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Average the bucket over ranks (what DDP's default hook does) and count it."""
        buf = bucket.buffer()
        state.calls += 1
        state.bytes += buf.numel() * buf.element_size()
        buf.div_(dist.get_world_size())
        fut = dist.all_reduce(buf, op=dist.ReduceOp.SUM, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])


@dataclass
class SavedBytes:
    """Bytes and number of tensors autograd saved for backward while the counter was active."""

    bytes: int = 0
    tensors: int = 0
    _seen: set = field(default_factory=set, repr=False)


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), str(t.device))


@contextmanager
def saved_tensor_bytes(exclude: Iterable[torch.Tensor] = ()) -> Iterator[SavedBytes]:
    """Count what autograd saves for backward in this block (storage counted once, however often saved).

    Args:
        exclude: tensors not to count, typically `model.parameters()`: a Linear saves its weight for backward,
            which is not an activation. Pass them to count activations only.

        with saved_tensor_bytes() as saved:
            loss = model(x).sum()
        print(saved.bytes)
    """
    counter = SavedBytes()
    skip = {_key(t) for t in exclude}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key not in counter._seen and key not in skip:
            counter._seen.add(key)
            counter.bytes += t.untyped_storage().nbytes()
            counter.tensors += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield counter
