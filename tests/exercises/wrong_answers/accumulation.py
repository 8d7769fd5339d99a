"""Wrong: the loss is not divided at all (the update is about k times too large)."""

import contextlib

from torch import nn


def accumulation_step(ddp_model, optimizer, micro_batches):
    k = len(micro_batches)
    for micro_step, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if micro_step == k - 1 else ddp_model.no_sync():
            nn.functional.cross_entropy(ddp_model(x), y).backward()  # the bug: no division
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
