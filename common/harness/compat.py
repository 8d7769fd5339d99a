"""Differences between torch versions that the lessons bridge in one place.

The repository pins torch 2.13.0 (requirements.txt), but a GPU machine often comes with the torch its image
ships (benchmarks/gpu_check.sh ran on 2.11). Only what a lesson needs is here, each with the version that
changed it.
"""

from __future__ import annotations

import inspect

from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

__all__ = ["ddp_buffer_sync", "batchnorm_has_bias_flag"]


def ddp_buffer_sync(sync: bool) -> dict:
    """DDP's keyword argument that turns the pre-forward buffer broadcast on or off, for this torch.

    torch 2.13 calls it `forward_sync_buffers` and deprecates `broadcast_buffers` with a FutureWarning; older
    releases only have `broadcast_buffers`. One difference: in 2.13 `forward_sync_buffers=False` still copies
    rank 0's buffers once when DDP wraps the model, while the old `broadcast_buffers=False` skips that copy too
    (torch/nn/parallel/distributed.py). Use: `DDP(model, **ddp_buffer_sync(False))`.
    """
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return (
        {"forward_sync_buffers": sync}
        if "forward_sync_buffers" in params
        else {"broadcast_buffers": sync}
    )


def batchnorm_has_bias_flag() -> bool:
    """Whether BatchNorm's constructor takes `bias=` (torch 2.13 does, 2.11 does not and always has a bias)."""
    return "bias" in inspect.signature(_BatchNorm.__init__).parameters
