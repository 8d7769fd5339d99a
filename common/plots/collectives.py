"""Each collective before and after, one box per rank, from the tensors real gloo ranks held (notebook 02).

    from exercises._ranks import run_on_ranks
    states = run_on_ranks("common.plots.collectives:collective_states", 4, len(COLLECTIVES))
    plot_collectives(states)

Rank k starts every collective from lesson 02's input x_k = [0, 1, 2, 3] + 100 k (integers in float32: the
sums are exact), so a value tells where it came from: 100 k + j is rank k's j-th element, anything else is a
sum.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

__all__ = ["COLLECTIVES", "collective_states", "describe_states", "plot_collectives"]

DEMO_LEN = 4  # lesson 02's x_k has 4 elements
# (name, the call as the lesson writes it); reduce_scatter_tensor splits x_k into world_size pieces
COLLECTIVES = [
    ("broadcast", "broadcast(t, src=0)"),
    ("reduce", "reduce(t, dst=0)"),
    ("all_reduce", "all_reduce(t)"),
    ("reduce_scatter", "reduce_scatter_tensor(out, t)"),
    ("all_gather", "all_gather_into_tensor(out, t)"),
]


def collective_states():
    """Run on every rank of a gloo group (exercises._ranks.run_on_ranks): yields, for each collective of
    COLLECTIVES in order, (name, before, after) as lists of floats; `after` is None where the collective
    leaves this rank's buffer undefined (reduce on a rank other than dst)."""
    import torch
    import torch.distributed as dist

    n, r = dist.get_world_size(), dist.get_rank()
    x = torch.arange(DEMO_LEN, dtype=torch.float32) + 100 * r
    for name, _ in COLLECTIVES:
        t = x.clone()
        if name == "broadcast":
            dist.broadcast(t, src=0)
        elif name == "reduce":
            dist.reduce(t, dst=0)
        elif name == "all_reduce":
            dist.all_reduce(t)
        elif (
            name == "reduce_scatter"
        ):  # needs DEMO_LEN divisible by world size: piece r of every rank's x
            t = torch.empty(DEMO_LEN // n)
            dist.reduce_scatter_tensor(t, x)
        else:
            t = torch.empty(DEMO_LEN * n)
            dist.all_gather_into_tensor(t, x)
        yield name, x.tolist(), (None if name == "reduce" and r != 0 else t.tolist())


def describe_states(states) -> list[str]:
    """One line per collective: what each rank holds after it (from `run_on_ranks`' answers)."""
    lines = []
    for i, (_name, call) in enumerate(COLLECTIVES):
        after = [
            "undefined" if s[i][2] is None else "[" + " ".join(f"{v:g}" for v in s[i][2]) + "]"
            for s in states
        ]
        lines.append(f"{call:<31} " + "  ".join(f"r{r}: {a}" for r, a in enumerate(after)))
    return lines


def _cell_colour(value: float, n: int, cmap):
    k, j = divmod(value, 100)
    return cmap(int(k)) if 0 <= k < n and j < DEMO_LEN and value == int(value) else "0.55"


def _draw_rank_boxes(ax, rows, n: int, width: int, cmap) -> None:
    """rows[r]: rank r's values (None: undefined); one box per rank, one cell per element."""
    for r, values in enumerate(rows):  # the box is as long as the rank's tensor
        box = width if values is None else len(values)
        ax.add_patch(plt.Rectangle((-0.1, r - 0.45), box + 0.2, 0.9, fill=False, lw=1.2))
        if values is None:
            ax.text(
                width / 2,
                r,
                "undefined (scratch)",
                ha="center",
                va="center",
                fontsize=7,
                color="0.4",
            )
            continue
        for j, v in enumerate(values):
            ax.add_patch(
                plt.Rectangle((j + 0.05, r - 0.35), 0.9, 0.7, color=_cell_colour(v, n, cmap))
            )
            ax.text(j + 0.5, r, f"{v:g}", ha="center", va="center", fontsize=6.5, color="white")
    ax.set_xlim(-0.3, width + 0.3)
    ax.set_ylim(n - 0.4, -0.6)
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=7)
    ax.set_xticks([])
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)


def plot_collectives(states, figsize=None):
    """Before | after for every collective, one box per rank; colour = the rank a value came from, grey = a
    sum. `states[r][i]` = (name, before, after) as `collective_states` yields them on rank r."""
    n = len(states)
    cmap = plt.get_cmap("tab10")
    widest = max(len(s[i][2] or []) for s in states for i in range(len(COLLECTIVES)))
    fig, axes = plt.subplots(
        len(COLLECTIVES),
        2,
        figsize=figsize or (11, 1.25 * n * len(COLLECTIVES) / 2.6),
        gridspec_kw={"width_ratios": [DEMO_LEN + 1, widest + 1]},
    )
    for i, (_name, call) in enumerate(COLLECTIVES):
        _draw_rank_boxes(axes[i, 0], [s[i][1] for s in states], n, DEMO_LEN, cmap)
        _draw_rank_boxes(axes[i, 1], [s[i][2] for s in states], n, widest, cmap)
        axes[i, 0].set_title(f"before {call}", fontsize=8, loc="left")
        axes[i, 1].set_title(f"after {call}", fontsize=8, loc="left")
    fig.suptitle(
        f"{n} gloo ranks, rank k starts from x_k = [0 1 2 3] + 100 k; colour: the rank a value came "
        "from, grey: a sum over ranks",
        fontsize=8,
    )
    fig.tight_layout()
    return fig
