"""Small matplotlib helpers for the notebooks (introduced in notebook 01)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

__all__ = ["plot_curves", "plot_rank_indices"]


def plot_curves(
    curves: dict[str, Sequence[float]],
    xlabel: str = "epoch",
    ylabel: str = "",
    title: str = "",
    ax=None,
    logy: bool = False,
):
    """One line per named curve, x = 1, 2, ...; returns the Axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 3))
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=name)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


def plot_rank_indices(
    indices_per_rank: Sequence[Sequence[int]], dataset_len: int, title: str = "", ax=None
):
    """Draw which dataset index each rank reads at each step: one row per rank, padding repeats hatched.

    Args:
        indices_per_rank: indices_per_rank[r] is the list rank r's sampler yields.
        dataset_len: len(dataset); repeats of an index already drawn are padding.
    """
    if ax is None:
        _, ax = plt.subplots(
            figsize=(
                max(4, 0.5 * max(map(len, indices_per_rank)) + 1.5),
                0.6 * len(indices_per_rank) + 1,
            )
        )
    cmap = plt.get_cmap("tab20", max(dataset_len, 1))
    seen: set[int] = set()
    for step in range(max(map(len, indices_per_rank))):
        for r, idx in enumerate(indices_per_rank):
            if step >= len(idx):
                continue
            i = idx[step]
            repeat = i in seen
            seen.add(i)
            ax.add_patch(
                plt.Rectangle(
                    (step, r),
                    0.95,
                    0.9,
                    color=cmap(i % 20),
                    alpha=0.4 if repeat else 0.9,
                    hatch="//" if repeat else None,
                )
            )
            ax.text(step + 0.47, r + 0.45, str(i), ha="center", va="center", fontsize=8)
    ax.set_xlim(0, max(map(len, indices_per_rank)))
    ax.set_ylim(len(indices_per_rank), 0)
    ax.set_yticks(
        [r + 0.45 for r in range(len(indices_per_rank))],
        [f"rank {r}" for r in range(len(indices_per_rank))],
    )
    ax.set_xlabel("position in the rank's epoch")
    ax.set_title(title)
    return ax
