"""DDP's gradient buckets, recorded from a real backward and drawn as a timeline (notebook 03).

    # needs a process group: a world of one will do
    events = record_buckets(DigitsCNN(), batch, bucket_cap_mb=0.01)
    plot_bucket_timeline(events)

Each parameter's gradient is timed when autograd finishes accumulating it (a post-accumulate-grad hook), each
bucket when DDP hands it to its communication hook: the moment its all-reduce is launched, while backward is
still computing the gradients of earlier layers. The hook is PyTorch's own `allreduce_hook` (sum, / world
size). In a world of one the all-reduce moves no bytes, but the buckets and the moments DDP launches them are
the same as on n ranks: both depend only on the model, `bucket_cap_mb` and the order backward produces the
gradients.
"""

import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ["bucket_lines", "plot_bucket_timeline", "record_buckets"]


def record_buckets(model: torch.nn.Module, batch, bucket_cap_mb: float, steps: int = 2) -> dict:
    """Train `steps` SGD steps under DDP and return the last backward's events: {"ready": [(ms, name)],
    "buckets": [(ms, index, [names], bytes)], "backward_ms": end}, times from the start of that backward.
    DDP rebuilds its buckets in the order gradients arrived after the first step, so steps >= 2."""
    names = {p: n for n, p in model.named_parameters()}
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    events: dict = {}

    def on_grad(param):
        events["ready"].append(((time.perf_counter() - events["t0"]) * 1e3, names[param]))

    def on_bucket(state, bucket):
        events["buckets"].append(
            (
                (time.perf_counter() - events["t0"]) * 1e3,
                bucket.index(),
                [names[p] for p in bucket.parameters()],
                bucket.buffer().numel() * 4,
            )
        )
        return default_hooks.allreduce_hook(state, bucket)

    handles = [p.register_post_accumulate_grad_hook(on_grad) for p in model.parameters()]
    ddp.register_comm_hook(dist.group.WORLD, on_bucket)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch
    try:
        for _ in range(steps):
            loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            events.update(ready=[], buckets=[], t0=time.perf_counter())
            loss.backward()  # returns once every bucket's all-reduce has been waited for
            events["backward_ms"] = (time.perf_counter() - events["t0"]) * 1e3
            opt.step()
    finally:
        for h in handles:
            h.remove()
    return events


def bucket_lines(events: dict) -> list[str]:
    """The buckets in the order their all-reduces were launched, and how many were launched before the last
    gradient was ready (no times printed: the lines are the same on every run)."""
    buckets = sorted(events["buckets"])
    lines = [
        f"all-reduce {i + 1}: bucket {index}, {size / 1024:.1f} KiB: " + ", ".join(params)
        for i, (_, index, params, size) in enumerate(buckets)
    ]
    last_ready = max(ms for ms, _ in events["ready"])
    early = sum(ms < last_ready for ms, *_ in buckets)
    lines.append(
        "all-reduces launched while backward was still computing gradients: "
        f"{early} of {len(buckets)}"
    )
    return lines


def plot_bucket_timeline(events: dict, ax=None):
    """One row per parameter (in the order its gradient was ready), a dot when it was ready, coloured by its
    bucket; a vertical line where each bucket's all-reduce was launched; the end of backward dashed."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.32 * len(events["ready"]) + 1.2))
    cmap = plt.get_cmap("tab10")
    bucket_of = {
        name: k for k, (_, _, params, _) in enumerate(sorted(events["buckets"])) for name in params
    }
    for row, (ms, name) in enumerate(events["ready"]):
        ax.plot([0, ms], [row, row], color="0.85", lw=1)
        ax.plot(ms, row, "o", color=cmap(bucket_of.get(name, 9) % 10))
        ax.text(-0.01 * events["backward_ms"], row, name, ha="right", va="center", fontsize=7)
    row_of = {name: row for row, (_, name) in enumerate(events["ready"])}
    for k, (ms, index, params, size) in enumerate(sorted(events["buckets"])):
        ax.axvline(ms, color=cmap(k % 10), lw=2, alpha=0.7)
        last = max(
            row_of.get(name, 0) for name in params
        )  # the label sits below the bucket's last gradient
        ax.text(
            ms,
            last + 0.5,
            f" all-reduce {k + 1}: bucket {index}, {size / 1024:.1f} KiB",
            color=cmap(k % 10),
            fontsize=7,
            va="center",
        )
    ax.axvline(events["backward_ms"], color="k", ls="--", lw=1)
    ax.text(events["backward_ms"], -0.45, " backward() returns", fontsize=7)
    ax.set_ylim(len(events["ready"]) + 0.2, -0.7)
    ax.set_yticks([])
    ax.set_xlabel("ms since backward() started (this run, this machine)")
    ax.set_title(
        "gradients ready (dots, coloured by bucket) and each bucket's all-reduce launched (lines)",
        fontsize=8,
    )
    return ax
