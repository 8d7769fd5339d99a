"""Pictures of data movement for notebooks 06-08, measured from real tensors, groups and hooks.

record_micro_steps(model, variant, micro_batches)  # 07: the micro-step each bucket all-reduce ran in
plot_micro_step_timeline(rows, k)                  # 07: F+B boxes per micro-step, a mark per all-reduce
saved_bytes_timeline(model, forward, loss_of)      # 08: live saved-activation bytes, tensor by tensor
plot_rank_contributions(per_rank, total, labels)   # 06: what each rank puts into an all-reduce, gets back
"""

# No `from __future__ import annotations`: DDP rejects a comm hook whose annotations are strings.
import contextlib
import datetime
import socket
import weakref

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

from common.measure.counters import CommCounter
from common.measure.memory import storage_key

__all__ = [
    "one_process_group",
    "record_micro_steps",
    "micro_step_timelines",
    "plot_micro_step_timeline",
    "saved_bytes_timeline",
    "plot_saved_bytes",
    "plot_rank_contributions",
]


class _StepCounter(CommCounter):
    """A CommCounter that also notes the micro-step each bucket all-reduce runs in."""

    def __init__(self):
        super().__init__()
        self.micro_step, self.events = -1, []

    def register(self, ddp_model):
        ddp_model.register_comm_hook(self, _StepCounter.hook)
        return self

    @staticmethod
    def hook(state, bucket):
        state.events.append(state.micro_step)
        return CommCounter.hook(state, bucket)


@contextlib.contextmanager
def one_process_group():
    """A gloo process group of one rank (this process) on a free port, for DDP in a notebook."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Tracked(list):
    """The micro-batch list the lesson's variant iterates; iterating it tells the counter the micro-step."""

    def __init__(self, items, counter):
        super().__init__(items)
        self.counter = counter

    def __iter__(self):
        for i, item in enumerate(list.__iter__(self)):
            self.counter.micro_step = i
            yield item


def record_micro_steps(model, variant, micro_batches) -> list[int]:
    """Run `variant(model, micro_batches)` (a lesson 07 function) on the DDP `model` and return, for each
    bucket all-reduce DDP launched, the micro-step (0..k-1) whose backward launched it. Registers a comm hook:
    call once per fresh DDP model, after one warm-up backward if the rebuilt buckets are wanted."""
    counter = getattr(model, "_micro_step_counter", None)
    if counter is None:
        counter = model._micro_step_counter = _StepCounter()
        counter.register(model)
    counter.events = []
    variant(model, _Tracked(micro_batches, counter))
    model.zero_grad(set_to_none=True)
    return list(counter.events)


VARIANTS = ("accumulate", "accumulate_backward_only_no_sync", "accumulate_always_sync")


def micro_step_timelines(variants=VARIANTS, k: int = 4, seed: int = 0):
    """On every rank of the current process group (`one_process_group()` in a notebook, or the ranks of
    exercises._ranks.run_on_ranks): lesson 07's ResidualMLP under DDP, one warm-up step (DDP rebuilds its
    buckets after the first), then each variant on k micro-batches of 4.
    Yields {variant: record_micro_steps(...)}."""
    import importlib

    from torch.nn.parallel import DistributedDataParallel as DDP

    from common.models import ResidualMLP

    lesson = importlib.import_module("lessons.07_gradient_accumulation")
    torch.manual_seed(seed + dist.get_rank())  # each rank its own micro-batches
    x, y = torch.randn(4 * k, 1, 8, 8), torch.randint(10, (4 * k,))
    micro, rows = list(zip(x.split(4), y.split(4))), {}
    for name in variants:
        torch.manual_seed(seed)  # the same initial weights on every rank
        model = DDP(ResidualMLP(width=256, depth=4))
        record_micro_steps(model, lesson.accumulate, micro[:1])
        rows[name] = record_micro_steps(model, getattr(lesson, name), micro)
    yield rows


def plot_micro_step_timeline(rows: dict, k: int, ax=None):
    """rows: {variant name: record_micro_steps(...)}. One row per variant, a box per micro-step (forward +
    backward), a red bar per bucket all-reduce in the micro-step that launched it."""
    if ax is None:
        _, ax = plt.subplots(figsize=(1.6 * k + 2.5, 0.8 * len(rows) + 1))
    for r, (_name, events) in enumerate(rows.items()):
        for m in range(k):
            ax.add_patch(plt.Rectangle((m, r + 0.1), 0.9, 0.5, color="C0", alpha=0.35))
            ax.text(m + 0.45, r + 0.35, f"F+B {m}", ha="center", va="center", fontsize=8)
            n = events.count(m)
            for j in range(
                n
            ):  # one thin red bar per bucket, side by side at the end of the micro-step
                ax.add_patch(plt.Rectangle((m + 0.62 + 0.1 * j, r + 0.62), 0.08, 0.28, color="C3"))
        ax.text(k + 0.05, r + 0.5, f"{len(events)} all-reduces", va="center", fontsize=8)
    ax.set_xlim(0, k + 1.1)
    ax.set_ylim(len(rows), 0)
    ax.set_yticks([r + 0.5 for r in range(len(rows))], list(rows))
    ax.set_xticks([])
    ax.set_xlabel(
        "micro-steps of one optimizer step (blue: forward + backward, red: a bucket all-reduce)"
    )
    return ax


def saved_bytes_timeline(model, forward, loss_of) -> list[tuple[str, int]]:
    """Run `out = forward()` and `loss_of(out).backward()` and return (phase, live bytes) after every tensor
    autograd saves or frees: the bytes saved for backward and still held, each storage once, parameters
    excluded, each storage named by `common.measure.memory.storage_key` (as `saved_bytes` counts them, whose
    peak this timeline reaches). Phase: "forward" until the first free, then "backward".
    Tensors a checkpointed block recomputes in backward are held by the checkpoint, outside these hooks."""
    params = {storage_key(p)[0] for p in model.parameters()}
    live, refs, timeline = [0], {}, []

    def release(key):
        refs[key][1] -= 1
        if refs[key][1] == 0:
            live[0] -= refs.pop(key)[0]
            timeline.append(("backward", live[0]))

    class Held:  # what autograd keeps instead of the tensor; dropped when the node's backward has run
        def __init__(self, t):
            self.t = t

    def pack(t):
        key, nbytes = storage_key(t)
        if key in params:
            return t
        held = Held(t)
        entry = refs.setdefault(key, [nbytes, 0])
        live[0] += entry[0] * (entry[1] == 0)
        entry[1] += 1
        weakref.finalize(held, release, key)
        timeline.append(
            ("backward" if any(p == "backward" for p, _ in timeline) else "forward", live[0])
        )
        return held

    def unpack(h):
        return h.t if isinstance(h, Held) else h

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = (
            forward()
        )  # the model's forward only: the loss's own saved tensors are not the model's
    loss_of(out).backward()
    del out
    return timeline


def plot_saved_bytes(timelines: dict, ax=None):
    """timelines: {name: saved_bytes_timeline(...)}; live saved bytes (MB) against the event number."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3))
    for name, tl in timelines.items():
        ys = [0] + [b / 1e6 for _, b in tl]
        ax.plot(range(len(ys)), ys, drawstyle="steps-post", label=f"{name} (peak {max(ys):.3f} MB)")
        turn = next((i for i, (p, _) in enumerate(tl) if p == "backward"), len(tl))
        ax.axvline(turn + 0.5, color=ax.lines[-1].get_color(), ls=":", lw=1)
    ax.set(
        xlabel="saved-tensor events (dotted: backward starts freeing)",
        ylabel="saved activations held (MB)",
    )
    ax.legend(fontsize=8)
    return ax


def plot_rank_contributions(per_rank, total, labels, title: str = "", ax=None):
    """One box per rank with the vector it hands to an all-reduce (SUM), and the sum every rank gets back."""
    rows = [[float(v) for v in t] for t in per_rank] + [[float(v) for v in total]]
    if ax is None:
        _, ax = plt.subplots(figsize=(2.2 * len(labels) + 2.5, 0.55 * len(rows) + 1.2))
    for r, row in enumerate(rows):
        last = r == len(rows) - 1
        for j, v in enumerate(row):
            ax.add_patch(
                plt.Rectangle(
                    (j, r + 0.08 + 0.3 * last),
                    0.95,
                    0.84,
                    color="C2" if last else f"C{r % 10}",
                    alpha=0.35,
                )
            )
            ax.text(
                j + 0.47, r + 0.5 + 0.3 * last, f"{v:.4g}", ha="center", va="center", fontsize=9
            )
    ax.axhline(len(per_rank) + 0.2, color="k", lw=1)
    ax.set_xlim(0, len(labels))
    ax.set_ylim(len(rows) + 0.4, 0)
    ax.set_xticks([j + 0.47 for j in range(len(labels))], labels)
    ax.xaxis.tick_top()
    ax.set_yticks(
        [r + 0.5 + 0.3 * (r == len(per_rank)) for r in range(len(rows))],
        [f"rank {r} sends" for r in range(len(per_rank))] + ["all-reduce (SUM):\nevery rank gets"],
    )
    ax.set_title(title, fontsize=10)
    return ax
