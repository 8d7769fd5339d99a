"""FSDP2's knobs as bytes a rank holds, drawn from lesson 14's results (notebook 14)."""

from __future__ import annotations

import matplotlib.pyplot as plt

__all__ = ["plot_knobs"]


def plot_knobs(results: dict):
    """Three bar groups from one run's --results JSON: parameter bytes at rest (DDP, HSDP, FSDP), parameter bytes
    held from forward to backward per reshard_after_forward setting, gradient bytes held after a micro-step with
    gradient sync off and on. Every bar is a measured number; returns the figure."""
    claims = results["claims"]
    reshard = {k: v["params"] for k, v in results["reshard_rows"].items()}
    grads = {
        f"sync {s}": claims[f"accumulation_held_sync_{s.lower()}"]["value"]
        for s in ("False", "True")
    }
    panels = [
        ("parameters at rest", results["parameter_bytes"]),
        ("held forward -> backward\n(reshard_after_forward=)", reshard),
        ("gradients after micro-step 1", grads),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3), sharey=True)
    for ax, (title, bars) in zip(axes, panels):
        ax.bar(list(bars), list(bars.values()), color="tab:blue")
        for i, v in enumerate(bars.values()):
            ax.text(i, v, f"{v}", ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("bytes per rank")
    fig.tight_layout()
    return fig
