"""When DDP sends module buffers (BatchNorm's running statistics): count it (lesson 06; any lesson with no_sync).

DDP(..., forward_sync_buffers=True), the default (torch 2.13's name; `broadcast_buffers` is deprecated and warns
with a FutureWarning), copies rank 0's buffers to every rank before a forward ONLY when the previous forward ran
with gradient sync: `_post_forward` sets `require_forward_param_sync` to `torch.is_grad_enabled() and
require_backward_grad_sync`, and `_pre_forward` broadcasts only while it is True (it starts True). So a forward
after one under `no_grad` or `no_sync` sends nothing. Source: torch/nn/parallel/distributed.py
(`will_sync_module_buffers`, `_sync_buffers`, `_default_broadcast_coalesced`).

Both that broadcast and DDP's construction-time broadcast of parameters and buffers (`_sync_module_states`, which
`forward_sync_buffers=False` does not turn off) end in `torch.distributed._broadcast_coalesced`;
`count_buffer_broadcasts` counts its calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["count_buffer_broadcasts", "broadcasts_after_eval"]


@contextmanager
def count_buffer_broadcasts() -> Iterator[list[int]]:
    """Count the calls of `dist._broadcast_coalesced` in the block. Yields a list: the bytes of each call.

        with count_buffer_broadcasts() as sent:
            loss = ddp_model(x).sum()
        len(sent)   # 1 if this forward broadcast rank 0's buffers, 0 otherwise

    DDP looks the function up on the `torch.distributed` module at call time, so replacing it there sees every
    call; it is restored on exit, even on error.
    """
    real, calls = dist._broadcast_coalesced, []

    def counting(group, tensors, *args, **kwargs):
        calls.append(sum(t.numel() * t.element_size() for t in tensors))
        return real(group, tensors, *args, **kwargs)

    dist._broadcast_coalesced = counting
    try:
        yield calls
    finally:
        dist._broadcast_coalesced = real


def broadcasts_after_eval(model, data, device: torch.device) -> tuple[int, int]:
    """After an evaluation (forwards under no_grad) through the DDP wrapper `model`: the buffer broadcasts of
    one training step, then of 2 optimizer steps of 3 micro-steps each, no_sync on the first 2 (lesson 06).

    `data` yields (x, y) batches (7 are used); forward + backward only, no optimizer: only the broadcasts
    matter. Returns (broadcasts of the first step, broadcasts of the 2 accumulation steps)."""

    def micro_step(x, y, sync: bool) -> None:
        with nullcontext() if sync else model.no_sync():
            F.cross_entropy(model(x.to(device)), y.to(device)).backward()

    with count_buffer_broadcasts() as first:  # the training step after the evaluation
        micro_step(*next(data), sync=True)
    with count_buffer_broadcasts() as accumulation:
        for micro, (x, y) in enumerate(data):
            micro_step(x, y, sync=micro % 3 == 2)
    return len(first), len(accumulation)
