"""Gradient accumulation through Accelerate and Lightning Fabric, as variants for lesson 07's
`common.data_parallel.accumulation.Proof` (23): each library's idiom, with the three loss normalisations a
reader meets (the mean as it is, divided by k, summed over samples and divided by the rank's sample count).

`accelerator.accumulate(model)` enters `model.no_sync()` unless its step counter reaches a multiple of
gradient_accumulation_steps, and `accelerator.backward(loss)` divides the loss by gradient_accumulation_steps
first (accelerate/accelerator.py, `backward`). Fabric's `no_backward_sync(model, enabled)` is `no_sync()` and
leaves the loss alone (lightning_fabric/fabric.py). `RIGHT` is what lesson 23 measures: which normalisation
gives one SGD step on the global batch under each.
"""

from __future__ import annotations

import argparse

import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.data_parallel.accumulation import Proof
from common.data_parallel.micro_batches import no_sync_unless
from common.measure.counters import CommCounter
from common.models import ResidualMLP

__all__ = [
    "RIGHT",
    "RIGHT_UNEVEN",
    "scaled",
    "no_sync_variant",
    "accelerate_variant",
    "fabric_variant",
    "library_proofs",
]


def scaled(how: str, k: int, n_local: int):
    """The loss a micro-step hands to backward: as it is, / k, or summed over samples / n_local."""

    def loss_of(model, x, y):
        if how == "by_samples":  # the sum of sample losses / this rank's k x micro_batch samples
            return F.cross_entropy(model(x), y, reduction="sum") / n_local
        loss = F.cross_entropy(model(x), y)
        return loss / k if how == "divide_by_k" else loss

    return loss_of


def no_sync_variant(how, k, n_local):
    """Lesson 07's pattern: no_sync on every micro-step but the last, forward and backward inside."""
    loss_of = scaled(how, k, n_local)

    def variant(model, micro_batches):
        for micro_step, (x, y) in enumerate(micro_batches):
            with no_sync_unless(model, last=micro_step == len(micro_batches) - 1):
                loss_of(model, x, y).backward()

    return variant


def accelerate_variant(accelerator, how, k, n_local):
    """accelerator.accumulate around forward and backward, accelerator.backward for backward."""
    loss_of = scaled(how, k, n_local)

    def variant(model, micro_batches):
        for x, y in micro_batches:
            with accelerator.accumulate(model):  # no_sync unless step % k == 0
                accelerator.backward(loss_of(model, x, y))  # divides by k before backward

    return variant


def fabric_variant(fabric, how, k, n_local):
    """fabric.no_backward_sync on every micro-step but the last, fabric.backward for backward."""
    loss_of = scaled(how, k, n_local)

    def variant(model, micro_batches):
        for micro_step, (x, y) in enumerate(micro_batches):
            last = micro_step == len(micro_batches) - 1
            with fabric.no_backward_sync(model, enabled=not last):  # no_sync; the loss is yours
                fabric.backward(loss_of(model, x, y))

    return variant


# which normalisation gives the global batch's mean gradient, under each library (measured)
RIGHT = {
    "ddp": {"nothing": False, "divide_by_k": True, "by_samples": True},
    "accelerate": {"nothing": True, "divide_by_k": False, "by_samples": False},
    "fabric": {"nothing": False, "divide_by_k": True, "by_samples": True},
}
# ... when a rank's micro-batches differ in size ([15, 1] at k = 2 of 8): only the sample count is right
# where you normalise, and Accelerate's own division by k weights the one sample as much as the fifteen
RIGHT_UNEVEN = {
    "ddp": {"divide_by_k": False, "by_samples": True},
    "accelerate": {"nothing": False},
    "fabric": {"divide_by_k": False, "by_samples": True},
}


def library_proofs(init: dict, accelerator, fabric, info, report) -> dict:
    """Lesson 07's `Proof` around the same ResidualMLP (from `init`) three ways: "ddp" (DDP by hand),
    "accelerate" (`accelerator.prepare`) and "fabric" (`fabric.setup`), each counting its bucket all-reduces.
    The step: SGD without momentum at lr 0.1, where a step scaled by 1/k moves the parameters by >= 1e-3
    (lesson 07's bound for a wrong variant)."""
    proof_args = argparse.Namespace(
        lr=0.1, grad_accum_steps=accelerator.gradient_accumulation_steps
    )
    proofs = {}
    for lib in ("ddp", "accelerate", "fabric"):
        raw = ResidualMLP().to(info.device)
        raw.load_state_dict(init)
        if lib == "ddp":
            model = DDP(raw) if info.distributed else raw
        elif lib == "accelerate":
            model = accelerator.prepare(raw)
        else:
            model = fabric.setup(raw)
        ddp = getattr(model, "_forward_module", model)
        counter = CommCounter().register(ddp) if info.distributed else CommCounter()
        proofs[lib] = Proof(model, raw, init, counter, proof_args, info, report)
    return proofs
