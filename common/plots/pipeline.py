"""Pipeline timelines drawn from a run's own timestamps: one row per rank, F/B boxes per micro-batch, the bubble
as white space (notebook 09; the events come from `common.pipeline.stage_timers.TimedStage`)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt

__all__ = ["plot_timeline"]


def plot_timeline(
    events_per_rank: Sequence[Sequence[tuple]], title: str = "", ax=None, unit: float = 1e3
):
    """Gantt chart of a recorded step: one row per rank, forward boxes light, backward boxes dark, labelled
    with the micro-batch (and the stage, `F0s2`, when a rank holds several). Times in ms. Returns the Axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.5 * len(events_per_rank) + 1))
    t0 = min(e[2] for evs in events_per_rank for e in evs)
    several = any(len({e[4] for e in evs}) > 1 for evs in events_per_rank)
    cmap = plt.get_cmap("tab10")
    for k, evs in enumerate(events_per_rank):
        for kind, i, s, e, stage in evs:
            ax.barh(
                k,
                (e - s) * unit,
                left=(s - t0) * unit,
                height=0.8,
                color=cmap(i % 10),
                alpha=0.45 if kind == "F" else 0.95,
                edgecolor="black",
                linewidth=0.5,
                hatch="//" if several and stage >= len(events_per_rank) else None,
            )
            label = f"{kind}{i}" + (f"s{stage}" if several else "")
            ax.text((s - t0 + (e - s) / 2) * unit, k, label, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(events_per_rank)), [f"rank {k}" for k in range(len(events_per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("time since the step began (ms)")
    ax.set_title(title)
    return ax
