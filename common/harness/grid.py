"""The parallelism grid: each rank's coordinates and process groups by name (dp, pp, tp, ...), on a DeviceMesh.

Every lesson that splits work more than one way asks the grid instead of computing ranks by hand:

    grid = Grid(info, dp=2, tp=2)          # 4 ranks: dp is the outer dimension, tp the inner one
    grid.coords                            # {"dp": 1, "tp": 0} on global rank 2
    grid.group("tp")                       # the ProcessGroup of the ranks that differ only in their tp coordinate
    grid.ranks_in("tp")                    # [2, 3]: the global ranks in this rank's tp group

Layout: the global ranks, 0 .. world_size-1, laid out row-major as `torch.arange(world_size).view(*sizes)` in the
order the sizes are given, the last dimension innermost (as picotron's `process_group_manager.py` does with
(dp, pp, tp) and torchtitan's `ParallelDims` with (pp, dp, ..., tp)). Consecutive ranks share the innermost group,
so put the dimension that talks most (tp) last: on a GPU node its ranks are neighbours on the fast links; and
the one that talks least (pp: activations at stage boundaries) first, so that its groups span nodes
(torchtitan's and Megatron-LM's order, lesson 11's).

It is built on `torch.distributed.device_mesh.init_device_mesh`
(https://pytorch.org/docs/stable/distributed.html#torch.distributed.device_mesh.init_device_mesh), which creates
one process group per mesh dimension and hands out the `DeviceMesh` that DTensor, `parallelize_module` and
`fully_shard` take. A plain `python` run (no process group) gets a grid whose every size is 1 and whose groups
are None. used by lessons 06 (SyncBatchNorm groups) and 09 (pipeline stages) on.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from common.harness.env import DistInfo, LessonError

__all__ = ["Grid", "grid_layout"]


def grid_layout(sizes: dict[str, int]) -> torch.Tensor:
    """The global ranks arranged on the grid: a tensor of shape `tuple(sizes.values())`, row-major.

    Example: {"dp": 2, "tp": 2} -> [[0, 1], [2, 3]]: ranks 0 and 1 form a tp group, ranks 0 and 2 a dp group.
    """
    return torch.arange(math.prod(sizes.values())).view(*sizes.values())


def _check_sizes(sizes: dict[str, int], world_size: int) -> None:
    if not sizes:
        raise LessonError("a grid needs at least one dimension, e.g. dp=WORLD_SIZE")
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
    if bad:
        raise LessonError(f"grid sizes must be positive integers, got {bad}")
    if math.prod(sizes.values()) != world_size:
        product = " x ".join(f"{k}={v}" for k, v in sizes.items())
        raise LessonError(
            f"grid {product} = {math.prod(sizes.values())} ranks, but the world has {world_size}: "
            f"the sizes must multiply to the world size"
        )


class Grid:
    """This rank's place on a grid of named parallel dimensions, and the process group of each dimension.

    Args:
        info: this process (`common.harness.session.setup`); its rank and world size.
        **sizes: the size of each dimension, outermost first, e.g. `dp=2, pp=1, tp=2`; their product must equal
            the world size. Dimensions of size 1 are allowed (their group holds this rank alone).

    Attributes:
        sizes: {name: size}, in the order given.
        coords: {name: this rank's index along that dimension} (`dp_rank`, `tp_rank`, ... in picotron's words).
        mesh: the `DeviceMesh` (None without a process group).

    Raises:
        LessonError: a size is not a positive integer, or the sizes do not multiply to the world size. Every rank
            computes the same check before any collective, so every rank fails alike and none waits.
    """

    def __init__(self, info: DistInfo, **sizes: int):
        _check_sizes(sizes, info.world_size)
        self.info = info
        self.sizes = dict(sizes)
        layout = grid_layout(self.sizes)
        where = (
            (layout == info.rank).nonzero()[0].tolist()
        )  # this rank's index along each dimension
        self.coords = dict(zip(self.sizes, where))
        self._layout = layout
        self.mesh = None
        if info.distributed:
            self.mesh = init_device_mesh(
                info.device.type, tuple(self.sizes.values()), mesh_dim_names=tuple(self.sizes)
            )

    def size(self, name: str) -> int:
        """How many ranks share this rank's group along `name` (`dp_size`, `tp_size`, ...)."""
        return self.sizes[self._known(name)]

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The process group along `name` that holds this rank; None without a process group."""
        self._known(name)
        return None if self.mesh is None else self.mesh.get_group(name)

    def ranks_in(self, name: str) -> list[int]:
        """The global ranks of this rank's group along `name`, in order of their coordinate along it."""
        index = tuple(slice(None) if k == self._known(name) else c for k, c in self.coords.items())
        return self._layout[index].tolist()

    def submesh(self, name: str):
        """The one-dimensional `DeviceMesh` along `name` (for `parallelize_module`, `fully_shard`); None without
        a process group."""
        return None if self.mesh is None else self.mesh[self._known(name)]

    def is_first(self, name: str) -> bool:
        """Coordinate 0 along `name` (`pp_is_first_stage` for name "pp")."""
        return self.coords[self._known(name)] == 0

    def is_last(self, name: str) -> bool:
        """The last coordinate along `name` (`pp_is_last_stage` for name "pp")."""
        return self.coords[self._known(name)] == self.sizes[name] - 1

    def describe(self) -> list[str]:
        """Lines that draw the grid: every group along every dimension as its list of global ranks."""
        lines = [
            " x ".join(f"{k}={v}" for k, v in self.sizes.items())
            + f" = {self._layout.numel()} ranks"
        ]
        for axis, name in enumerate(self.sizes):
            moved = self._layout.movedim(axis, -1).reshape(-1, self.sizes[name])
            lines.append(f"{name} groups: " + " ".join(str(row.tolist()) for row in moved))
        return lines

    def _known(self, name: str) -> str:
        if name not in self.sizes:
            raise KeyError(f"the grid has no dimension {name!r}; it has {list(self.sizes)}")
        return name

    def __repr__(self) -> str:
        return f"Grid(rank={self.info.rank}, sizes={self.sizes}, coords={self.coords})"
