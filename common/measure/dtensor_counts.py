"""Count what DTensor and FSDP2 communicate: collectives, their bytes and their groups (lessons 10, 11).

`common.measure.counters.count_collectives` wraps the Python functions of `torch.distributed`; DTensor
(`parallelize_module`) calls functional collectives (`torch.ops._c10d_functional.*`), which it does not see, and
FSDP2 (`fully_shard`) calls `dist.all_gather_single` and `dist.reduce_scatter_single`, which it counts too. All of
them reach the dispatcher as ops, where `torch.distributed.tensor.debug.CommDebugMode` counts them
(https://pytorch.org/docs/stable/distributed.tensor.html#debugging). This subclass of it also records each one's
bytes and group, into the same `CollectiveCount` that `count_collectives` fills, so a lesson compares the two.
The bytes saved for backward are `common.measure.memory.saved_bytes`'s (a DTensor counts by its local shard).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from common.measure.counters import CollectiveCount

__all__ = ["count_dtensor_collectives"]

_NAMES = {
    "all_reduce": "all_reduce",
    "allreduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "broadcast_": "broadcast",
    "all_to_all_single": "all_to_all",
    "alltoall_base_": "all_to_all",
}


class _Counted(CommDebugMode):
    """CommDebugMode, which sees DTensor's functional collectives and FSDP2's c10d ops below the Python API,
    also recording each one's bytes (its largest tensor) and group ranks into a CollectiveCount."""

    def __init__(self, counter: CollectiveCount):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = getattr(getattr(func, "_overloadpacket", None), "__name__", "")
        if name in _NAMES and not any(issubclass(t, DTensor) for t in types):
            op, c = _NAMES[name], self.counter
            boxed = [
                a for a in args if isinstance(a, torch.ScriptObject)
            ]  # c10d ops: the group comes first
            group = (
                dist.ProcessGroup.unbox(boxed[0])
                if boxed  # functional ops: the group name comes last
                else dist.distributed_c10d._resolve_process_group(
                    [a for a in args if isinstance(a, str)][-1]
                )
            )
            tensors = [
                t
                for a in args
                for t in (a if isinstance(a, (list, tuple)) else [a])
                if isinstance(t, torch.Tensor)
            ]
            nbytes = max(t.numel() * t.element_size() for t in tensors)
            if (
                op == "all_gather" and name == "all_gather_into_tensor"
            ):  # functional: args are (shard, n, group)
                nbytes *= dist.get_world_size(group)
            key = (op, tuple(dist.get_process_group_ranks(group)))
            c.calls[op], c.bytes[op] = c.calls.get(op, 0) + 1, c.bytes.get(op, 0) + nbytes
            c.groups[key] = c.groups.get(key, 0) + 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextmanager
def count_dtensor_collectives() -> Iterator[CollectiveCount]:
    """Count the collectives DTensor (parallelize_module) and FSDP2 (fully_shard) issue inside the block:
    calls, bytes (the full buffer, as `count_collectives` counts) and {(op, group ranks): calls}."""
    counter = CollectiveCount()
    with warnings.catch_warnings(), _Counted(counter):
        # CommDebugMode's module tracker uses full backward hooks, which warn when a module's inputs need no grad
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        yield counter
