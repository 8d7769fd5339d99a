"""Minimal 08: memory -- what autograd keeps for backward, and what checkpointing and bf16 change.

    torchrun --standalone --nproc_per_node=2 minimal/08_memory.py
    python minimal/08_memory.py                                     # plain python: a world of one

A forward saves what backward needs, the activations (counted here with saved_tensors_hooks).
Checkpointing keeps each block's input only and recomputes the block in backward: the same gradients
for fewer bytes. bf16 autocast halves the activations but keeps a bf16 copy of each weight.
Lesson: lessons/08_memory.py.
"""

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

B, W, D = 128, 256, 4  # lesson 08's micro-batch per rank, width and depth


class ResidualMLP(nn.Module):
    """Lesson 08's model: stem 64 -> W, D residual blocks (Linear, GELU, Linear), head W -> 10."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(64, W)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(W, W), nn.GELU(), nn.Linear(W, W)) for _ in range(D)
        )
        self.head = nn.Sequential(nn.GELU(), nn.Linear(W, 10))

    def forward(self, x, checkpointing=False):  # x (B, 64) -> logits (B, 10)
        h = self.stem(x)
        for block in self.blocks:  # checkpointed: saves h (B, W) only, recomputes the block later
            h = h + (checkpoint(block, h, use_reentrant=False) if checkpointing else block(h))
        return self.head(h)


def saved_bytes(model, x, checkpointing=False) -> int:
    """Bytes autograd saves for backward during one forward: each storage once, weights excluded."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = {}  # storage -> its bytes: a storage saved twice (or a view of it) counts once

    def pack(t):  # called for every tensor saved for backward
        sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, checkpointing)
    return sum(n for ptr, n in sizes.items() if ptr not in weights)


def train(args, rank, world_size, device) -> None:
    # --- data and model ---
    with np.load(Path(__file__).resolve().parent.parent / "data" / "digits.npz") as f:
        x = torch.from_numpy(f["images"].astype(np.float32) / 16.0).flatten(1)  # (1797, 64)
        y = torch.from_numpy(f["labels"].astype(np.int64))  # (1797,)
    mine = rank * B + torch.arange(B)  # this rank's B digits, copied: a view would keep all of x
    x, y = x[mine].to(device), y[mine].to(device)  # (B, 64), (B,)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    raw_model = ResidualMLP().to(device)
    model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None)

    # --- activations: plain, checkpointed, bf16 autocast ---
    saved, grads = {}, {}
    for ck in (False, True):
        saved["checkpointing" if ck else "plain"] = saved_bytes(raw_model, x, ck)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x, ck), y).backward()  # DDP averages the gradients, as in training
        grads[ck] = torch.cat([p.grad.flatten() for p in raw_model.parameters()])
    with torch.autocast(device.type, dtype=torch.bfloat16):
        saved["bf16 autocast"] = saved_bytes(raw_model, x)
    # plain: the stem's input (B, 64), 3 (B, W) per block, 2 in the head, 4 bytes each; checkpoint:
    # 1 per block; bf16: 2 bytes each + a bf16 copy of each weight but the stem's (x needs no grad)
    formula = {
        "plain": 4 * B * (64 + W * (3 * D + 2)),
        "checkpointing": 4 * B * (64 + W * (D + 2)),
        "bf16 autocast": 2 * B * (64 + W * (3 * D + 2)) + 2 * (2 * D * W * W + W * 10),
    }

    # --- the check: the bytes follow from the shapes; checkpointing gives the same gradients ---
    diff = (grads[True] - grads[False]).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    share, worst = saved["checkpointing"] / saved["plain"], diff.item()
    if rank == 0:  # one JSON line: the bytes are lesson 08's at its defaults
        out = dict(saved_bytes=saved, checkpointing_share=share, checkpointing_max_grad_diff=worst)
        print(json.dumps(out))
    assert saved == formula, (saved, formula)
    torch.testing.assert_close(grads[True], grads[False], rtol=0, atol=1e-5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    # --- setup: one process per device, started by torchrun (which sets RANK, WORLD_SIZE, ...) ---
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # the device on this node; RANK is global
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: NCCL binds this process to its GPU
    if "RANK" not in os.environ:  # plain python: what torchrun would set, for a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT="0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # reads those variables
    try:
        train(args, rank, world_size, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
