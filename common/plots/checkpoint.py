"""Who wrote which bytes of a sharded checkpoint, and who read them back (notebook 15).

Drawn from the run's own records: the chunks in the checkpoint's `.metadata`
(`common.checkpoint.sharded.chunks_written`) and the bytes each loading rank reads from each saving rank's file.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

__all__ = ["plot_written_and_read"]


def _kind(fqn: str) -> str:
    """model.stem.weight -> "parameters"; optim.state.stem.weight.exp_avg -> "exp_avg"."""
    return "parameters" if fqn.startswith("model.") else fqn.rsplit(".", 1)[-1]


def plot_written_and_read(chunks: list[dict], read_plan: list[list[int]]):
    """Left: the bytes in each saving rank's file, by kind of state. Right: the bytes each loading rank read
    from each file. Returns the Figure."""
    saved_by = 1 + max(c["rank"] for c in chunks)
    kinds = sorted({_kind(c["fqn"]) for c in chunks})
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.4))
    bottom = np.zeros(saved_by)
    for kind in kinds:
        kb = np.zeros(saved_by)
        for c in chunks:
            if _kind(c["fqn"]) == kind:
                kb[c["rank"]] += c["bytes"] / 1e3
        ax.bar([f"__{r}_0.distcp" for r in range(saved_by)], kb, bottom=bottom, label=kind)
        bottom += kb
    ax.set(ylabel="kB", title=f"written: each of {saved_by} ranks its own file")
    ax.legend(fontsize=8)
    plan = np.array(read_plan) / 1e3
    image = bx.imshow(plan, cmap="Blues", aspect="auto")
    for (k, r), v in np.ndenumerate(plan):
        bx.text(r, k, f"{v:.1f}", ha="center", va="center", fontsize=8)
    bx.set(
        xticks=range(saved_by),
        yticks=range(len(read_plan)),
        xlabel="file of saving rank",
        ylabel="loading rank",
        title=f"read back by {len(read_plan)} ranks (kB)",
    )
    fig.colorbar(image, ax=bx)
    fig.tight_layout()
    return fig
