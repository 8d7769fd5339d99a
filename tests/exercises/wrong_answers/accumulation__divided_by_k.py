"""Wrong: lesson 07's minimal script copied: each micro-batch's mean loss divided by k, right only for equal
micro-batches (here 5, 5, 5, 1: the 1-sample micro-batch weighs as much as a 5-sample one)."""

import contextlib

from torch import nn


def accumulation_step(ddp_model, optimizer, micro_batches):
    k = len(micro_batches)
    for micro_step, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if micro_step == k - 1 else ddp_model.no_sync():
            (nn.functional.cross_entropy(ddp_model(x), y) / k).backward()  # the bug: / k
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
