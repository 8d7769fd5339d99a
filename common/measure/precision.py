"""Mixed precision by name, and how far two training steps end apart (lessons 07 and 08).

- `autocast_context(device, "bf16" | "fp16" | "fp32")`: `torch.autocast` with that dtype, a no-op for fp32
  (https://pytorch.org/docs/stable/amp.html). fp16 also needs a `torch.amp.GradScaler`; bf16 does not (its
  exponent range is fp32's).
How far two runs end apart is `common.measure.differences.max_abs_diff_all` (and `max_over_ranks` across
replicas), NaN-safe.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # a type only: the instruments import nothing from the harness
    pass

__all__ = ["PRECISIONS", "autocast_context"]

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
