"""Minimal 13: ZeRO stages 1, 2 and 3 by hand -- each rank keeps 1/N of the training state.

    torchrun --standalone --nproc_per_node=2 minimal/13_sharded_data_parallel.py
    python minimal/13_sharded_data_parallel.py                      # plain python: a world of one

The parameters live in one flat vector of N x s elements; rank r owns [r*s, (r+1)*s), its Adam
updates that slice only (stage 1: 1/N of the optimizer state); stage 2 reduce-scatters the gradient
(a rank gets its slice's sum only); stage 3 frees the whole parameters between steps. Each equals
DDP. The measured lesson (lessons/13_sharded_data_parallel.py) shards layer by layer, and FSDP2.
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
from torch.nn.utils import parameters_to_vector, vector_to_parameters


def make_model(w: int = 33) -> nn.Module:
    """x (B, 1, 8, 8) -> logits (B, 10): 2485 parameters, an odd number, so the flat vector pads."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, w), nn.GELU(), nn.Linear(w, 10))


def gather(flat, shard):
    """Every rank's slice into the flat vector: the whole parameters (again: stage 3 freed them)."""
    flat.untyped_storage().resize_(flat.numel() * flat.element_size())
    dist.all_gather_single(flat, shard.detach().clone())  # torch < 2.13: all_gather_into_tensor


def train(args, rank, world_size, device) -> None:
    # --- data and the reference: DDP + Adam, global batches of 64 ---
    with np.load(Path(__file__).resolve().parent.parent / "data" / "digits.npz") as f:
        x_all = torch.from_numpy(f["images"].astype(np.float32) / 16.0).unsqueeze(1)  # (N, 1, 8, 8)
        y_all = torch.from_numpy(f["labels"].astype(np.int64))  # (1797,) digits 0..9
    perm = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(args.seed))
    b = 64 // world_size  # step t: the samples perm[64t: 64t + 64], rank r the r-th b of them
    idx = [perm[(t * 64 + rank * b + torch.arange(b)) % len(perm)] for t in range(args.steps)]
    data = [(x_all[i].to(device), y_all[i].to(device)) for i in idx]
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    raw_model = make_model().to(device)
    init = parameters_to_vector(raw_model.parameters()).detach()  # (n,) all parameters, flat
    model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(raw_model.parameters(), lr=1e-3)
    for x, y in data:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()  # DDP averages the gradients over ranks
        optimizer.step()
    want = parameters_to_vector(raw_model.parameters()).detach()
    ddp_state = sum(t.nbytes for v in optimizer.state.values() for t in v.values())  # Adam's bytes

    for stage in (1, 2, 3):
        # --- shard: one flat vector of N x s elements; the model's parameters are views of it ---
        model, n = make_model().to(device), len(init)
        s = -(-n // world_size)  # elements per rank; the last up to N - 1 are padding
        flat = torch.cat([init, init.new_zeros(world_size * s - n)])
        vector_to_parameters(flat[:n], model.parameters())  # p.data = a view of flat, each p
        shard = nn.Parameter(flat[rank * s : (rank + 1) * s].clone())  # the slice this rank owns
        optimizer, losses = torch.optim.Adam([shard], lr=1e-3), []  # moments for s elements, not n
        if stage == 3:
            flat.untyped_storage().resize_(0)  # at rest a rank holds its shard only
        for x, y in data:  # --- the training loop ---
            if stage == 3:
                gather(flat, shard)  # the whole parameters, for forward and backward
            loss = F.cross_entropy(model(x), y)  # mean over this rank's b samples
            loss.backward()
            grad = torch.zeros_like(flat)  # / N, then summed over ranks, as DDP does
            grad[:n] = parameters_to_vector(p.grad for p in model.parameters()) / world_size
            model.zero_grad(set_to_none=True)
            if stage == 1:  # the whole summed gradient on every rank, as DDP; use my slice
                dist.all_reduce(grad)
                shard.grad = grad[rank * s : (rank + 1) * s]
            else:  # all-reduce = reduce-scatter + all-gather: get only my slice's sum
                shard.grad = torch.empty_like(shard)
                dist.reduce_scatter_single(shard.grad, grad)  # torch < 2.13: reduce_scatter_tensor
            optimizer.step()  # Adam on my slice only (shard.grad is replaced at every step)
            if stage < 3:
                gather(flat, shard)  # every rank's new slice: the whole new model
            else:
                flat.untyped_storage().resize_(0)  # freed until the next step
            losses.append(loss.item())
        gather(flat, shard)  # --- the check: the whole parameters equal DDP's ---
        diff = (flat[:n] - want).abs().max()
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        state = sum(t.nbytes for v in optimizer.state.values() for t in v.values())  # Adam's
        line = dict(stage=stage, max_diff=diff.item(), adam_state_bytes=state, losses=losses)
        if rank == 0:  # one JSON line per stage, full precision
            print(json.dumps({**line, "ddp_adam_state_bytes": ddp_state}))
        torch.testing.assert_close(flat[:n], want, rtol=0, atol=1e-6)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
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
