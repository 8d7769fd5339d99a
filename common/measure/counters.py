"""Instruments that make communication and activation memory visible without a GPU (lessons 06 to 09 on).

- `CommCounter`: a DDP communication hook that counts the all-reduce calls DDP makes (one per gradient bucket)
  and their bytes, then performs the same averaging all-reduce as DDP's default hook.
  (https://pytorch.org/docs/stable/ddp_comm_hooks.html)
- `count_collectives`: counts the Python-level calls to `torch.distributed` collectives in a block, with their
  bytes and the ranks of the group each travelled in, and logs them in the order they were called.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "CommCounter",
    "CollectiveCount",
    "count_collectives",
    "local_shard",
]


@dataclass
class CommCounter:
    """Counts DDP's gradient all-reduces. Register with `ddp_model.register_comm_hook(counter, counter.hook)`.

    Attributes:
        calls: all-reduce calls (one per bucket per synchronised backward).
        bytes: bytes of gradient handed to those all-reduces (this rank's buffer sizes).
        group: the process group DDP averages over (None: the default group); `register` takes it from the DDP
            model, so a DDP on a sub-group (e.g. `process_group=grid.group("dp")`) is averaged over that group.
    """

    calls: int = 0
    bytes: int = 0
    group: object = None

    def reset(self) -> None:
        self.calls = 0
        self.bytes = 0

    def register(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> "CommCounter":
        """Install this counter as `ddp_model`'s communication hook (once, before the first backward)."""
        self.group = ddp_model.process_group
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
        buf.div_(dist.get_world_size(state.group))
        fut = dist.all_reduce(
            buf, op=dist.ReduceOp.SUM, group=state.group, async_op=True
        ).get_future()
        return fut.then(lambda f: f.value()[0])


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank really stores); any other tensor itself."""
    return getattr(t, "_local_tensor", t)


@dataclass
class CollectiveCount:
    """What `count_collectives` saw.

    Attributes:
        calls: {op name: calls}, e.g. {"all_reduce": 2}.
        bytes: {op name: bytes}: per call, the bytes of the largest tensor argument, i.e. the full buffer (the
            all-reduced tensor, an all-gather's output, a reduce-scatter's input): the Psi of the cost formulas.
        groups: {(op name, ranks of the group): calls}: which collective travelled in which group.
        log: [(op name, bytes)], one per call, in the order of the calls; `mark(name)` puts (name, 0) between
            them (e.g. from a module hook), so that the log says what ran between which collectives.
    """

    calls: dict = field(default_factory=dict)
    bytes: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict)
    log: list = field(default_factory=list)

    def mark(self, name: str) -> None:
        self.log.append((name, 0))

    @property
    def total(self) -> int:
        return sum(self.calls.values())


_P2P = ("send", "recv", "isend", "irecv")
_COUNTED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "broadcast",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "reduce",
)


def _nbytes(args, kwargs) -> int:
    sizes = [0]
    for a in [*args, *kwargs.values()]:
        for t in a if isinstance(a, (list, tuple)) else [a]:
            if isinstance(t, torch.Tensor):
                sizes.append(t.numel() * t.element_size())
    return max(sizes)


def _group_ranks(args, kwargs) -> tuple:
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    if group is None:
        return tuple(range(dist.get_world_size())) if dist.is_initialized() else (0,)
    return tuple(dist.get_process_group_ranks(group))


@contextmanager
def count_collectives(p2p: bool = False) -> Iterator[CollectiveCount]:
    """Count the Python-level calls to torch.distributed collectives inside the block (calls, bytes, groups).

    With `p2p=True`, point-to-point calls (send, recv, isend, irecv; a `P2POp` built inside the block for
    `batch_isend_irecv` captures the counting function too) are counted as well; their group is the `group=` passed.

    It wraps the functions on the `torch.distributed` module, which is where the lessons' code and
    nn.SyncBatchNorm (torch/nn/modules/_functions.py) look them up. Not counted: DDP's gradient all-reduce
    (C++; count it with `CommCounter`) and DTensor's functional collectives (count those with
    `torch.distributed.tensor.debug.CommDebugMode`). Restores the functions on exit, even on error.
    """
    counter = CollectiveCount()
    saved = {}
    for name in _COUNTED + (_P2P if p2p else ()):
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            counter.calls[_name] = counter.calls.get(_name, 0) + 1
            nbytes = _nbytes(args, kwargs)
            counter.bytes[_name] = counter.bytes.get(_name, 0) + nbytes
            counter.log.append((_name, nbytes))
            key = (_name, _group_ranks(args, kwargs))
            counter.groups[key] = counter.groups.get(key, 0) + 1
            return _fn(*args, **kwargs)

        setattr(dist, name, wrapped)
    try:
        yield counter
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
