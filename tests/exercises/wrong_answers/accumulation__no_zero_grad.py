"""Wrong: no zero_grad after the step: the next step's gradients add to this one's."""

import contextlib

from torch import nn


def accumulation_step(ddp_model, optimizer, micro_batches):
    k, samples = len(micro_batches), sum(len(y) for _, y in micro_batches)
    for micro_step, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if micro_step == k - 1 else ddp_model.no_sync():
            (nn.functional.cross_entropy(ddp_model(x), y, reduction="sum") / samples).backward()
    optimizer.step()  # the bug: the gradients are kept
