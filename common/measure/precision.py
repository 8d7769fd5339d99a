"""Mixed precision by name, and how far two training steps end apart (lessons 07 and 08).

- `autocast_context(device, "bf16" | "fp16" | "fp32")`: `torch.autocast` with that dtype, a no-op for fp32
  (https://pytorch.org/docs/stable/amp.html). fp16 also needs a `torch.amp.GradScaler`; bf16 does not (its
  exponent range is fp32's).
- `max_diff(a, b)`: the largest |a - b| over two lists of tensors (gradients, parameters); NaN if any is NaN.
- `worst_over_ranks(values, info)`: each number's maximum over ranks, so that one claim covers every replica
  (NaN if any rank's is NaN: see `common.measure.differences`).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from common.measure.differences import max_abs_diff, max_over_ranks, nan_max

if TYPE_CHECKING:  # a type only: the instruments import nothing from the harness
    from common.harness.env import DistInfo

__all__ = ["PRECISIONS", "autocast_context", "max_diff", "worst_over_ranks"]

PRECISIONS = ("fp32", "bf16", "fp16")


def autocast_context(device: torch.device, precision: str):
    """torch.autocast for "bf16" / "fp16" on this device type; a no-op for "fp32".

    Raises:
        ValueError: an unknown precision name.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(
        device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16
    )


def max_diff(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> float:
    """max |u - v| over pairs of same-shaped tensors, compared in float32 (0.0 for identical lists); NaN or inf
    when any element of either is (wherever it is: `common.measure.differences`)."""
    return nan_max(max_abs_diff(u.float(), v.float()) for u, v in zip(a, b))


def worst_over_ranks(values: list[float], info: DistInfo) -> list[float]:
    """Each value's maximum over ranks (every rank compared its own replica), NaN where any rank's is NaN; the
    same list on every rank."""
    if not info.distributed:
        return [nan_max([v]) for v in values]
    return [max_over_ranks(v) for v in values]
