"""Lesson 18's trade as a picture: the bytes each comm hook sends against the error of what arrives
(notebook 18).

The input is the `hooks` record of lesson 18's results JSON: one row per hook, {"hook", "bytes", "error"}, the
bytes all-reduced per step and |averaged gradient - the plain all-reduce's| / |the plain all-reduce's| on the
same batch (for PowerSGD the first compressed step: one power iteration from a random Q).
"""

from __future__ import annotations

import matplotlib.pyplot as plt

__all__ = ["plot_bytes_vs_error"]


def plot_bytes_vs_error(rows: list[dict], ax=None):
    """One point per hook: bytes per step (log x) against the relative gradient error (log y; the plain
    all-reduce's 0 is drawn at the bottom edge). Returns the Axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.4))
    floor = min(r["error"] for r in rows if r["error"] > 0) / 10
    for r in rows:
        y = max(r["error"], floor)
        ax.scatter(r["bytes"], y, s=40, zorder=3)
        ax.annotate(r["hook"], (r["bytes"], y), textcoords="offset points", xytext=(6, 4))
    ax.set(xscale="log", yscale="log", xlabel="bytes all-reduced per step (per rank)")
    ax.set_ylabel("|error| / |gradient|")
    ax.set_title("what each hook sends, and how far from the plain all-reduce it lands", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    return ax
