"""Lesson 23's run as a picture: for each library and each loss normalisation, how far one accumulated step lands
from one SGD step on the global batch (23). Drawn from the claims the lesson recorded."""

from __future__ import annotations

import matplotlib.pyplot as plt

__all__ = ["plot_normalisations"]

HOWS = ("nothing", "divide_by_k", "by_samples")


def _distance(claims: dict, lib: str, how: str) -> float:
    for suffix in ("equals_global_step", "changes_the_step"):
        claim = claims.get(f"{lib}_{how}_{suffix}")
        if claim is not None:
            return max(float(claim["value"]), 1e-10)  # 0 on a log axis: drawn at the floor
    raise KeyError(f"no claim for {lib} / {how}")


def plot_normalisations(results: dict, ax=None):
    """Grouped bars, log scale: max |parameter difference| from the global step, per library (by hand,
    Accelerate, Fabric) and per normalisation (loss as it is, / k, summed / samples), with lesson 07's two
    bounds (right within 1e-5, wrong beyond 1e-3). Returns the Axes."""
    claims = results["claims"]
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    libs = ("ddp", "accelerate", "fabric")
    width = 0.26
    for j, how in enumerate(HOWS):
        xs = [i + (j - 1) * width for i in range(len(libs))]
        ax.bar(xs, [_distance(claims, lib, how) for lib in libs], width, label=f"loss: {how}")
    ax.axhline(1e-5, color="green", ls="--", lw=1, label="right: <= 1e-5")
    ax.axhline(1e-3, color="red", ls=":", lw=1, label="wrong: >= 1e-3")
    ax.set_yscale("log")
    ax.set_xticks(range(len(libs)), ["by hand (no_sync)", "Accelerate", "Fabric"])
    ax.set(ylabel="max |param diff| vs global step", title="which loss normalisation is right")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax
