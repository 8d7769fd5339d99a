"""Who holds what, and when the gathers and frees happen: ZeRO-1/2/3 and FSDP2 as pictures (notebook 13).

Two pictures, both drawn from real tensors:
- `record_holdings` runs one forward, backward and step of a sharded model and, at each unit's forward and
  backward and after each phase, looks at every unit's tensors: are its full parameters there (ZeRO: the flat
  buffer's storage has bytes; FSDP2: the parameter is a plain tensor, not the DTensor shard), and does it hold
  full gradients (a `.grad` on a full parameter)? `plot_holdings` draws one grid per setup.
- `plot_who_holds` draws lesson 13's measured memory table: per setup and kind of state, the bytes each of N
  ranks holds as a fraction of DDP's, starting at the rank's own slice.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import matplotlib.pyplot as plt
import torch
import torch.nn as nn
from matplotlib.patches import Patch
from torch.distributed.tensor import DTensor

__all__ = ["record_holdings", "plot_holdings", "plot_who_holds"]

Probe = Callable[[], tuple[bool, bool]]  # () -> (full parameters present, full gradients held)


def zero_probe(unit) -> Probe:
    """A `common.sharding.zero.FlatUnit`'s state: flat storage with bytes; a gradient on a full parameter."""
    return lambda: (unit.gathered, any(p.grad is not None for p in unit.params))


def fsdp_probe(module: nn.Module) -> Probe:
    """A module under `fully_shard` (or inside one): plain tensors while unsharded, DTensor shards at rest."""

    def probe():
        params = list(module.parameters())
        return (
            not any(isinstance(p, DTensor) for p in params),
            any(p.grad is not None and not isinstance(p.grad, DTensor) for p in params),
        )

    return probe


def record_holdings(
    model: nn.Module, units: Sequence[tuple[str, nn.Module, Probe]], batch, step
) -> dict:
    """One forward, backward and `step()` of `model` on batch (x, y); each unit's (params, grads) state during its
    forward and its backward and after each phase. Returns {"events": [...], "units": [...], "state": [[...]]}."""
    events, state, handles = [], [], []

    def snap(event: str):
        events.append(event)
        state.append([probe() for _, _, probe in units])

    outputs = []  # (name, the unit's output): hooked once forward is done, after every hook the wrapper added

    def on_output(name: str, out) -> None:
        if torch.is_tensor(out) and out.requires_grad:
            outputs.append((name, out))

    for name, module, _ in units:
        leaves = [
            m
            for m in module.modules()
            if not list(m.children()) and list(m.parameters(recurse=False))
        ]
        handles.append(leaves[0].register_forward_pre_hook(lambda m, a, n=name: snap(f"F {n}")))
        handles.append(module.register_forward_hook(lambda m, a, out, n=name: on_output(n, out)))
    x, y = batch
    with (
        warnings.catch_warnings()
    ):  # FSDP2 warns that a wrapped module returned a view (harmless here)
        warnings.filterwarnings("ignore", message=".*returned a view tensor")
        loss = nn.functional.cross_entropy(model(x), y)
    snap("after forward")
    for name, out in outputs:  # backward reaches the unit's output: its weights are needed next
        out.register_hook(lambda grad, n=name: snap(f"B {n}"))
    loss.backward()
    snap("after backward")
    step()
    snap("after step")
    for h in handles:
        h.remove()
    return {"events": events, "units": [name for name, _, _ in units], "state": state}


def plot_holdings(records: dict[str, dict]):
    """One grid per setup (rows: units, columns: moments in the step); dark: the unit's full parameters are
    there, light: only the shard; an orange dot: full gradients held. Returns the Figure."""
    fig, axes = plt.subplots(
        len(records), 1, figsize=(11, 1.35 * len(records) + 0.8), squeeze=False
    )
    for ax, (title, rec) in zip(axes[:, 0], records.items()):
        for col, row_state in enumerate(rec["state"]):
            for row, (params, grads) in enumerate(row_state):
                ax.add_patch(
                    plt.Rectangle((col, row), 0.94, 0.88, color="tab:blue" if params else "#d6e4f0")
                )
                if grads:
                    ax.plot(col + 0.47, row + 0.44, "o", color="tab:orange", markersize=7)
        ax.set_xlim(0, len(rec["events"]))
        ax.set_ylim(len(rec["units"]), 0)
        ax.set_yticks([r + 0.44 for r in range(len(rec["units"]))], rec["units"], fontsize=7)
        ax.set_xticks(
            [c + 0.47 for c in range(len(rec["events"]))],
            rec["events"] if ax is axes[-1, 0] else [""] * len(rec["events"]),
            rotation=30,
            ha="right",
            fontsize=7,
        )
        ax.tick_params(length=0)
        ax.set_title(title, fontsize=9, loc="left")
    fig.legend(
        handles=[
            Patch(color="tab:blue", label="full parameters (gathered)"),
            Patch(color="#d6e4f0", label="only this rank's shard"),
            plt.Line2D([], [], marker="o", ls="", color="tab:orange", label="full gradients held"),
        ],
        loc="upper right",
        ncol=3,
        fontsize=7,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


def plot_who_holds(
    table: dict[str, dict],
    rows: Sequence[str],
    world_size: int,
    parts: Sequence[str] = ("parameters", "gradients", "optimizer_state"),
):
    """Per setup (row) and part (column): N rank bars over the full buffer; rank r's bar starts at its own slice
    and is as long as the bytes it holds / DDP's (measured: 1 = all of it, 1/N = its shard). Returns the Figure."""
    n = world_size
    fig, axes = plt.subplots(
        len(rows),
        len(parts),
        figsize=(3.4 * len(parts), 0.95 * len(rows) + 0.8),
        squeeze=False,
        sharex=True,
    )
    colors = plt.get_cmap("tab10")
    for i, row in enumerate(rows):
        for j, part in enumerate(parts):
            ax = axes[i, j]
            frac = table[row][part] / table["DDP"][part]
            for r in range(n):
                start = (
                    0.0 if frac > 1 - 1 / n else r / n
                )  # whole (or nearly): from 0; a shard: its own slice
                ax.barh(r, min(frac, 1.0), left=start, height=0.8, color=colors(r))
            ax.set_xlim(0, 1)
            ax.set_ylim(n - 0.5, -0.5)
            ax.set_yticks(range(n), [f"rank {r}" for r in range(n)] if j == 0 else [], fontsize=6)
            ax.set_xticks([k / n for k in range(n + 1)], [])
            ax.grid(axis="x", alpha=0.4)
            ax.text(1.0, -0.6, f"{frac:.2f} of DDP's", ha="right", va="bottom", fontsize=7)
            if j == 0:
                ax.set_ylabel(row, rotation=0, ha="right", va="center", fontsize=9)
            if i == 0:
                ax.set_title(part.replace("_", " "), fontsize=9, pad=12)
    fig.suptitle(
        f"what each of {n} ranks holds (measured bytes / DDP's; the x axis is the whole buffer)",
        fontsize=9,
    )
    fig.tight_layout()
    return fig
