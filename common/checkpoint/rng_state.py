"""Every random stream a training step draws from, captured and restored exactly (lesson 16): torch, numpy,
`random`, CUDA and per-rank `torch.Generator`s, on every rank."""

from __future__ import annotations

import random

import numpy as np
import torch

from common.harness.env import DistInfo

__all__ = ["capture_rng", "capture_rng_all_ranks", "restore_rng"]


def capture_rng(generator: torch.Generator, device: torch.device) -> dict:
    """This rank's random streams, as tensors and plain containers (what `torch.load(weights_only=True)` reads)."""
    np_state = np.random.get_state(
        legacy=False
    )  # {"state": {"key": uint32 array (624,), "pos"}, ...}
    state = {
        "torch": torch.get_rng_state(),
        "generator": generator.get_state(),
        "random": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
    }
    if (
        device.type == "cuda"
    ):  # dropout on a GPU draws from the device's generator, not torch.get_rng_state()
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def capture_rng_all_ranks(generator: torch.Generator, info: DistInfo) -> list[dict]:
    """Every rank's `capture_rng`, in rank order, on every rank (all_gather_object): the one writer saves them all."""
    rng = capture_rng(generator, info.device)
    if not info.distributed:
        return [rng]
    import torch.distributed as dist

    out = [None] * info.world_size
    dist.all_gather_object(out, rng)
    return out


def restore_rng(state: dict, generator: torch.Generator, device: torch.device) -> None:
    """Set every stream `capture_rng` saved back exactly (the inverse of `capture_rng`)."""
    torch.set_rng_state(state["torch"].cpu())
    generator.set_state(state["generator"].cpu())
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["random"]))
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
            "state": {"key": n["key"].cpu().numpy().astype(np.uint32), "pos": n["pos"]},
        }
    )
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
