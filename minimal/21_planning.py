"""Minimal 21: the bytes a data-parallel rank holds, by formula, against tensors built that way.

    torchrun --standalone --nproc_per_node=2 minimal/21_planning.py
    python minimal/21_planning.py                                 # plain python: a world of one

DDP with Adam, fp32: parameters 4P, gradients 4P, DDP's buckets 4P (a flat copy of the gradients),
Adam 8P + 4 bytes of `step` per tensor. ZeRO cuts each unit into N shards of s = ceil(n / N): stage 1
shards Adam's state, stage 2 the gradients too, stage 3 the parameters too. Mixed precision: 16 bytes
a parameter. "built" checks the arithmetic on tensors built here; lessons/21_planning.py measures."""

import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def make_units(w=33, depth=2):
    """Lesson 08's ResidualMLP as ZeRO units: stem, blocks, head (residual additions left out)."""
    block = [nn.Sequential(nn.Linear(w, w), nn.GELU(), nn.Linear(w, w)) for _ in range(depth)]
    return [nn.Linear(64, w), *block, nn.Sequential(nn.GELU(), nn.Linear(w, 10))]


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def formula(numels, tensors, N, stage):
    """Bytes per rank (fp32, Adam) by formula: predicted before anything is built."""
    P, shard = sum(numels), sum(math.ceil(n / N) for n in numels)
    if stage == 0:  # DDP's buckets: none in a world of one (no DDP to all-reduce for)
        buckets = 4 * P if N > 1 else 0
        adam = 8 * P + 4 * tensors
        return dict(parameters=4 * P, gradients=4 * P, ddp_buckets=buckets, optimizer_state=adam)
    params = 4 * (shard if stage == 3 else N * shard)
    grads = 4 * (P if stage == 1 else shard)
    return dict(parameters=params, gradients=grads, optimizer_state=8 * shard + 4 * len(numels))


def built(units, stage, rank, N, x, y):
    """One step; the tensors this rank would keep, built here and counted (numel x element size)."""
    model = nn.Sequential(*units)
    F.cross_entropy(model(x), y).backward()  # every gradient, whole
    params = list(model.parameters())
    if stage == 0:  # DDP: everything whole on every rank, and its bucket: the gradients, flat
        bucket = nbytes([torch.cat([p.grad.reshape(-1) for p in params])] if N > 1 else [])
        held, grads = nbytes(params), nbytes(p.grad for p in params)
        adam = adam_state_bytes(params)
        return dict(parameters=held, gradients=grads, ddp_buckets=bucket, optimizer_state=adam)
    flats, shards = [], []
    for u in units:
        ps = list(u.parameters())
        n = sum(p.numel() for p in ps)
        s = math.ceil(n / N)
        flat = F.pad(torch.cat([p.detach().reshape(-1) for p in ps]), (0, N * s - n))  # N x s
        full_grad = F.pad(torch.cat([p.grad.reshape(-1) for p in ps]), (0, N * s - n))
        shard = nn.Parameter(flat[rank * s : (rank + 1) * s].clone())
        shard.grad = torch.empty(s)
        dist.reduce_scatter_single(shard.grad, full_grad)  # this rank: the sum of its slice
        flats, shards = flats + [flat], shards + [shard]
    held = nbytes(shards if stage == 3 else flats)  # stage 3 frees the flat buffers between uses
    grads = nbytes(p.grad for p in (params if stage == 1 else shards))  # stage 1: all, whole
    return dict(parameters=held, gradients=grads, optimizer_state=adam_state_bytes(shards))


def adam_state_bytes(params):
    opt = torch.optim.Adam(params, lr=1e-3)
    opt.step()
    return nbytes(t for s in opt.state.values() for t in s.values())


def mixed_precision_bytes(units, x, y):
    """bf16 model + fp32 master copy + Adam: torch's bytes per parameter (no step counters)."""
    model = nn.Sequential(*units).to(torch.bfloat16)
    F.cross_entropy(model(x.to(torch.bfloat16)).float(), y).backward()
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    for m, p in zip(master, model.parameters()):
        m.grad = p.grad.float()
    adam = adam_state_bytes(master) - 4 * len(master)  # less the 4-byte step counters
    bf16 = nbytes(model.parameters()) + nbytes(p.grad for p in model.parameters())
    return (bf16 + nbytes(master) + adam) / sum(p.numel() for p in model.parameters())


def check(rank, N):
    rng = np.random.default_rng(rank)  # this rank's batch: x (16, 64), y (16,)
    x = torch.from_numpy(rng.standard_normal((16, 64)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, 16))
    numels = [sum(p.numel() for p in u.parameters()) for u in make_units()]
    tensors = sum(len(list(u.parameters())) for u in make_units())  # Adam: a `step` per tensor
    formulas = {s: formula(numels, tensors, N, s) for s in range(4)}
    builts = {s: built(make_units(), s, rank, N, x, y) for s in range(4)}
    mixed = mixed_precision_bytes(make_units(), x, y)
    out = dict(world_size=N, formula=formulas, built=builts, mixed_precision_bytes_per_param=mixed)
    ok = formulas == builts and mixed == 16.0
    if rank == 0:
        print(json.dumps(out))
        print("formula == the built bytes (DDP, ZeRO 1-3); 2 + 2 + 12 bytes per parameter:", ok)
    return ok


def main():
    rank, N = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    # CPU tensors, so gloo; on GPUs, LOCAL_RANK (os.environ["LOCAL_RANK"]) would pick the device
    if "RANK" not in os.environ:  # plain python: what torchrun would set, for a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT="0")
    dist.init_process_group("gloo")  # reads those variables
    try:
        ok = check(rank, N)
    finally:
        dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
