"""A hang as a picture: every rank's Python stack side by side (notebook 12).

The input is what `py-spy dump` printed for each rank, after `common.exhibits.hang_stacks.normalise_stack`: frames
innermost first, one per line as `    function (file:line)`. The picture stacks them outermost at the bottom, the
frames every rank shares in grey, and colours where each rank went its own way: red for a frame inside
torch.distributed (the rank waits in a collective), orange for any other (the rank never reached it).
"""

from __future__ import annotations

import re

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

__all__ = ["parse_py_spy", "plot_rank_stacks"]

FRAME = re.compile(r"^\s+(\S.*?) \((.+)\)$")
COLORS = {"shared": "lightgray", "collective": "tab:red", "elsewhere": "tab:orange"}


def parse_py_spy(text: str) -> list[tuple[str, str]]:
    """(function, file:line) per frame of one py-spy dump, outermost first."""
    frames = [m.groups() for m in map(FRAME.match, text.splitlines()) if m]
    return frames[::-1]


def shared_depth(stacks: list[list[tuple[str, str]]]) -> int:
    """How many outermost frames (function and line) every rank has in common."""
    depth = 0
    while all(len(s) > depth for s in stacks) and len({s[depth] for s in stacks}) == 1:
        depth += 1
    return depth


def plot_rank_stacks(dumps: dict[int, str], title: str = "where every rank is"):
    """One column per rank of its stack from `dumps` (rank -> normalised py-spy text); returns the Figure."""
    stacks = {rank: parse_py_spy(text) for rank, text in sorted(dumps.items())}
    depth = shared_depth(list(stacks.values()))
    height = max(map(len, stacks.values()))
    fig, ax = plt.subplots(figsize=(4.2 * len(stacks), 0.55 * height + 1.2))
    for col, (rank, frames) in enumerate(stacks.items()):
        for level, (func, where) in enumerate(frames):
            kind = (
                "shared"
                if level < depth
                else ("collective" if where.startswith("torch/distributed") else "elsewhere")
            )
            ax.add_patch(plt.Rectangle((col, level), 0.92, 0.85, color=COLORS[kind]))
            ax.text(
                col + 0.46, level + 0.42, f"{func}\n{where}", ha="center", va="center", fontsize=7
            )
        top = frames[-1][0] if frames else "(no frames)"
        inside = bool(frames) and frames[-1][1].startswith("torch/distributed")
        ax.text(
            col + 0.46,
            len(frames) + 0.2,
            f"rank {rank}: " + (f"waits in {top}" if inside else "never calls the collective"),
            ha="center",
            fontsize=9,
            weight="bold",
        )
    ax.set_xlim(-0.05, len(stacks))
    ax.set_ylim(0, height + 0.8)
    ax.axis("off")
    ax.legend(
        handles=[
            Patch(color=COLORS["shared"], label="frames every rank shares"),
            Patch(color=COLORS["collective"], label="inside torch.distributed"),
            Patch(color=COLORS["elsewhere"], label="where the ranks part, outside it"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.02),
        ncol=3,
        fontsize=7,
        frameon=False,
    )
    ax.set_title(f"{title} (outermost frame at the bottom)")
    fig.tight_layout()
    return fig
