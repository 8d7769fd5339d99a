"""Lesson 17's profile as a picture: one step per rank, the bucket all-reduces against backward (notebook 17).

The input is the `timeline` record of lesson 17's results JSON: for each bucket_cap_mb, a list over ranks of
{"steps": [StepProfile.to_dict(), ...]} cut from that rank's own chrome trace (`common.measure.profiling`).
"""

from __future__ import annotations

import matplotlib.pyplot as plt

__all__ = ["plot_bucket_overlap"]

PHASE_COLORS = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green"}


def _draw_rank(ax, step: dict, y: float, rank: int, label: bool) -> None:
    """Rank `rank`'s step at height y: its phases and backward compute above, gloo's all-reduces below."""
    for phase, (s, e) in step["phases"].items():
        ax.barh(
            y + 0.5,
            e - s,
            left=s,
            height=0.4,
            color=PHASE_COLORS[phase],
            label=phase if label else None,
        )
    s, e = step["backward_window"]
    ax.barh(
        y + 0.5,
        e - s,
        left=s,
        height=0.15,
        color="black",
        label="backward compute" if label else None,
    )
    # one bar per bucket, in the order they were issued
    for b, (s, e) in enumerate(step["allreduce"]):
        ax.barh(
            y,
            e - s,
            left=s,
            height=0.4,
            color=plt.cm.Reds(0.4 + 0.2 * b),
            edgecolor="k",
            label="bucket all-reduce" if label and b == 0 else None,
        )
        ax.text(s, y, f"b{b}", va="center", fontsize=7)
    ax.text(
        0,
        y + 0.95,
        f"rank {rank}: hidden {step['hidden_fraction']:.2f} of {step['allreduce_ms']:.1f} ms",
        fontsize=8,
    )


def plot_bucket_overlap(timeline: dict, panels: dict[str, str]):
    """One panel per bucket_cap_mb key of `timeline` (panels: key -> title); each rank's last profiled step,
    drawn in ms from its start. The part of an all-reduce bar under the black backward-compute bar is hidden
    behind backward; the rest is exposed. Returns the Figure."""
    fig, axes = plt.subplots(
        1, len(panels), figsize=(6 * len(panels), 3.2), sharey=True, squeeze=False
    )
    for ax, (cap, title) in zip(axes[0], panels.items()):
        for rank, prof in enumerate(timeline[cap]):
            _draw_rank(
                ax, prof["steps"][-1], 2 * (len(timeline[cap]) - 1 - rank), rank, label=rank == 0
            )
        n = len(timeline[cap])
        ticks = [t for r in range(n) for t in (2 * (n - 1 - r), 2 * (n - 1 - r) + 0.5)]
        names = [f"rank {r} {what}" for r in range(n) for what in ("all-reduce", "compute")]
        ax.set_yticks(ticks, names)
        ax.set_xlabel("ms from the step's start")
        ax.set_title(title, pad=16)
    fig.legend(
        *axes[0][0].get_legend_handles_labels(),
        loc="lower center",
        ncol=5,
        fontsize=7,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))  # room for the legend below the panels
    return fig
