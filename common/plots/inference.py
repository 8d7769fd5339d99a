"""Lesson 22's tensor-parallel decoding as a picture (notebook 22), from the run's own records:

- which rank caches which heads: `cache_heads` (rank -> its head indices) and `cache_bytes` (rank -> the bytes
  of its cache, counted from its tensors);
- the collectives of one generated token: `phases["decode"]["log"]`, the (op, bytes) of every collective one
  decode step called, in call order (layer by layer: attention's all-reduce, then the MLP's).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

__all__ = ["plot_tp_decode"]


def _cache(ax, heads: list[list[int]], nbytes: list[int]) -> None:
    n_heads = sum(len(h) for h in heads)
    for rank, mine in enumerate(heads):
        for h in range(n_heads):
            held = h in mine
            ax.add_patch(
                Rectangle((h, rank), 0.9, 0.8, color=f"C{rank}" if held else "0.93", alpha=0.8)
            )
            if held:
                ax.text(h + 0.45, rank + 0.4, f"K,V\nh{h}", ha="center", va="center", fontsize=8)
        ax.text(n_heads + 0.1, rank + 0.4, f"{nbytes[rank]} B", va="center", fontsize=8)
    ax.set(xlim=(0, n_heads + 1.2), ylim=(len(heads), 0), xticks=[], xlabel="heads")
    ax.set_yticks([r + 0.4 for r in range(len(heads))], [f"rank {r}" for r in range(len(heads))])
    ax.set_title("the KV cache: each rank holds its heads only", fontsize=9)


def _step(ax, log: list, layers: int) -> None:
    calls = [(op, b) for op, b in log if b]
    per_layer = len(calls) // max(layers, 1)
    x = 0.0
    for layer in range(layers):
        for i, (name, nbytes) in enumerate(calls[layer * per_layer : (layer + 1) * per_layer]):
            local = "attention\n(my heads)" if i == 0 else "MLP\n(my 4d/tp)"
            ax.add_patch(Rectangle((x, 0), 1.4, 1, color="0.85"))
            ax.text(x + 0.7, 0.5, local, ha="center", va="center", fontsize=7)
            ax.add_patch(Rectangle((x + 1.5, 0), 1.1, 1, color="C3", alpha=0.75))
            ax.text(x + 2.05, 0.5, f"{name}\n{nbytes} B", ha="center", va="center", fontsize=7)
            x += 2.7
        ax.text(x - 2.7 * per_layer + 0.1, 1.15, f"layer {layer}", fontsize=8)
    ax.set(xlim=(0, x), ylim=(0, 1.5), xticks=[], yticks=[])
    ax.set_title(f"one generated token: {len(calls)} all-reduces ({per_layer} a layer)", fontsize=9)


def plot_tp_decode(results: dict, layers: int):
    """Two panels: the heads each rank caches (with its bytes), and one decode step's collectives in call
    order. Returns the Figure."""
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(11, 2.6), gridspec_kw={"width_ratios": [1, 2.2]}
    )
    _cache(left, results["cache_heads"], results["cache_bytes"])
    _step(right, results["phases"]["decode"]["log"], layers)
    fig.tight_layout()
    return fig
