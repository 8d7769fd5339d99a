"""Pictures of who holds what in model parallelism, from the run's own tensors and groups (notebooks 10, 11).

Nothing here is drawn by hand: `plot_tp_shards` finds each rank's shard inside the unsplit tensor by value,
so a wrong split shows up as a wrong picture; `plot_mesh_groups` draws the groups lesson 11 counted
collectives in.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.colors import ListedColormap

__all__ = ["locate_shard", "owner_map", "plot_tp_shards", "plot_mesh_groups"]

RANK_COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red"]


def locate_shard(full: torch.Tensor, shard: torch.Tensor, dim: int) -> int | None:
    """The offset along `dim` at which `shard` equals a slice of `full` exactly, or None if nowhere."""
    width = shard.shape[dim]
    for start in range(full.shape[dim] - width + 1):
        if torch.equal(full.narrow(dim, start, width), shard):
            return start
    return None


def owner_map(full: torch.Tensor, shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """A map of `full`'s shape: the rank whose shard holds each element along `dim`, -1 where none does."""
    owner = torch.full(full.shape, -1, dtype=torch.long)
    for rank, shard in enumerate(shards):
        start = locate_shard(full, shard, dim)
        if start is not None:
            owner.narrow(dim, start, shard.shape[dim]).fill_(rank)
    return owner


def _draw_owner(ax, owner: torch.Tensor, title: str, xlabel: str, ylabel: str) -> None:
    n = max(int(owner.max()) + 1, 1)
    cmap = ListedColormap(["lightgray"] + RANK_COLORS[:n])
    ax.imshow(
        (owner + 1).numpy(), cmap=cmap, vmin=0, vmax=n, aspect="auto", interpolation="nearest"
    )
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)


def plot_tp_shards(
    full_w1: torch.Tensor,
    full_w2: torch.Tensor,
    w1_shards: Sequence[torch.Tensor],
    w2_shards: Sequence[torch.Tensor],
    full_h: torch.Tensor,
    h_shards: Sequence[torch.Tensor],
):
    """Three panels, one colour per tp rank: which rows of fc1.weight (column parallel: split by output
    features), which columns of the hidden activation h = GELU(fc1(x)) and which columns of fc2.weight
    (row parallel: split by input features) each rank holds. Gray: held by no rank (a wrong split).

    Args:
        full_w1: the unsplit fc1.weight (4H, H); w1_shards[r]: rank r's (4H/tp, H).
        full_w2: the unsplit fc2.weight (H, 4H); w2_shards[r]: rank r's (H, 4H/tp).
        full_h: the unsplit hidden activation as (tokens, 4H); h_shards[r]: rank r's (tokens, 4H/tp).
    Returns the Figure.
    """
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4), gridspec_kw={"width_ratios": [1, 2.2, 2.2]})
    o1, oh = owner_map(full_w1, w1_shards, 0), owner_map(full_h, h_shards, 1)
    o2 = owner_map(full_w2, w2_shards, 1)
    _draw_owner(
        axes[0],
        o1,
        f"fc1.weight {tuple(full_w1.shape)}\ncolumn parallel: rows",
        "in feature",
        "out feature",
    )
    _draw_owner(
        axes[1],
        oh,
        f"h = GELU(fc1(x)) {tuple(full_h.shape)}\neach rank computes its columns",
        "feature",
        "token",
    )
    _draw_owner(
        axes[2],
        o2,
        f"fc2.weight {tuple(full_w2.shape)}\nrow parallel: columns",
        "in feature",
        "out feature",
    )
    handles = [plt.Rectangle((0, 0), 1, 1, color=RANK_COLORS[r]) for r in range(len(w1_shards))]
    fig.legend(
        handles,
        [f"tp_rank {r}" for r in range(len(w1_shards))],
        loc="lower center",
        ncol=len(handles),
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def plot_mesh_groups(rows: Sequence[dict], layout: torch.Tensor, dims: Sequence[str], ax=None):
    """A 2-D mesh of ranks (outer axis down, inner across), one line per group in which something travelled.

    Args:
        rows: lesson 11's `<name>_groups` records: {"dim", "ranks", "op", "calls", "bytes"} each.
        layout: grid_layout({dims[0]: a, dims[1]: b}), the rank at each (outer, inner) coordinate.
        dims: the axis names, outer first.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 4))
    colors = dict(zip(("dp", "pp", "tp"), ("tab:blue", "tab:orange", "tab:green")))
    where = {
        int(layout[i, j]): (j, -i) for i in range(layout.shape[0]) for j in range(layout.shape[1])
    }
    labels: dict[tuple, list[str]] = {}
    for row in rows:
        labels.setdefault((row["dim"], tuple(row["ranks"])), []).append(
            f"{row['op']} x{row['calls']} {row['bytes']} B"
        )
    for (dim, ranks), text in labels.items():
        (x0, y0), (x1, y1) = where[ranks[0]], where[ranks[-1]]
        ax.plot([x0, x1], [y0, y1], color=colors.get(dim, "black"), lw=3, alpha=0.6)
        ax.text(
            (x0 + x1) / 2,
            (y0 + y1) / 2 + (0.08 if dim != "dp" else 0),
            f"{dim}: " + "\n".join(text),
            fontsize=7,
            ha="center",
            color=colors.get(dim, "black"),
        )
    for rank, (x, y) in where.items():
        ax.scatter([x], [y], s=600, color="white", edgecolor="black", zorder=3)
        ax.text(x, y, str(rank), ha="center", va="center", zorder=4)
    ax.set(
        title=" x ".join(dims),
        xlim=(-0.6, layout.shape[1] - 0.4),
        ylim=(-layout.shape[0] + 0.5, 0.5),
    )
    ax.axis("off")
    return ax
