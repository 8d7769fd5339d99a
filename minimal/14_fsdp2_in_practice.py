"""Minimal 14: FSDP2 in practice -- HSDP on a 2-D mesh, a model built on the meta device, accumulation.

    torchrun --standalone --nproc_per_node=4 minimal/14_fsdp2_in_practice.py     # HSDP: 2 replicas x 2 shards
    python minimal/14_fsdp2_in_practice.py                                       # a world of one

Meta device -> fully_shard, 2-D mesh -> to_empty -> eager's values; k micro-steps reduce once. Lesson 14.
all_gather_single, 86864 bytes a step on 2 x 2: k = 2 micro-steps, each the lesson's 43432 (blocks twice)."""

import json
import os
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor


class Net(nn.Module):
    # x (B, 64) -> logits (B, 10): (x - pixel_mean) * pixel_scale, stem, 2 residual blocks, head
    def __init__(self, w: int = 32):
        super().__init__()
        self.stem = nn.Linear(64, w)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(w, w), nn.GELU(), nn.Linear(w, w)) for _ in range(2)
        )
        self.head = nn.Sequential(nn.GELU(), nn.Linear(w, 10))
        self.register_buffer("pixel_mean", torch.linspace(0.0, 0.5, 64))  # in the state dict
        self.register_buffer("pixel_scale", torch.linspace(1.0, 2.0, 64), persistent=False)  # not

    def forward(self, x):
        h = self.stem((x - self.pixel_mean) * self.pixel_scale)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def init_like_eager(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for m in [m for m in model.modules() if isinstance(m, nn.Linear)]:  # eager's order
            full = nn.Linear(m.in_features, m.out_features)  # the numbers eager drew
            for mine, src in ((m.weight, full.weight), (m.bias, full.bias)):
                part = distribute_tensor(src, mine.device_mesh, mine.placements, src_data_rank=None)
                mine.to_local().copy_(part.to_local())  # my rows of my own copy; no comms
        model.pixel_mean.copy_(torch.linspace(0.0, 0.5, 64))  # to_empty left them uninitialised
        model.pixel_scale.copy_(torch.linspace(1.0, 2.0, 64))


def max_diff(a, b):  # a NaN anywhere gives NaN (Python's max would drop one not first)
    return torch.stack([(u - v).abs().max() for u, v in zip(a, b)]).max().item()


def counting(fn, counted):
    def wrapped(*args, **kwargs):  # + the bytes of its largest tensor: the full buffer
        tensors = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t)]
        counted[fn.__name__] += max(t.numel() * t.element_size() for t in tensors)
        return fn(*args, **kwargs)

    return wrapped


def main():
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # the device on this node; RANK is global
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: NCCL binds this process to its GPU
    if "RANK" not in os.environ:  # plain python: what torchrun would set, for a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT="0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # reads those variables
    try:
        dims = (2, world_size // 2) if world_size % 2 == 0 else (1, world_size)  # [[0, 1], [2, 3]]
        mesh = init_device_mesh(device.type, dims, mesh_dim_names=("dp_replicate", "dp_shard"))
        g = torch.Generator().manual_seed(0)
        steps, k, global_batch = 3, 2, 32  # 3 SGD steps, each of k = 2 micro-steps per rank
        x_all = torch.rand(steps, global_batch, 64, generator=g).to(device)
        data = list(zip(x_all, torch.randint(0, 10, (steps, global_batch), generator=g).to(device)))
        torch.manual_seed(0)  # eager: what one process would build and train on the global batch
        reference = Net().to(device)
        optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        eager = [*(p.detach().clone() for p in reference.parameters()), *reference.buffers()]
        for x, y in data:
            F.cross_entropy(reference(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        with torch.device("meta"):
            model = Net()  # shapes only
        for block in model.blocks:
            fully_shard(block, mesh=mesh)  # 2-D mesh: HSDP (shard on dim 1, replicate on dim 0)
        fully_shard(model, mesh=mesh)
        model.to_empty(device=device)  # each rank allocates its shards, uninitialised
        init_like_eager(model, seed=0)
        full = [*(p.full_tensor() for p in model.parameters()), *model.buffers()]
        init_diff = max_diff(full, eager)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # on DTensors: updates local shards
        counted = Counter()
        for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
            setattr(dist, name, counting(getattr(dist, name), counted))  # FSDP2 calls dist.<name>
        for x, y in data:  # rank r: the r-th 1/N of the batch, in k micro-batches
            xs, ys = x.chunk(world_size)[rank].chunk(k), y.chunk(world_size)[rank].chunk(k)
            for micro_step in range(k):
                model.set_requires_gradient_sync(micro_step == k - 1)  # reduce after the last only
                (F.cross_entropy(model(xs[micro_step]), ys[micro_step]) / k).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        diff = max_diff([p.full_tensor() for p in model.parameters()], reference.parameters())
        moved = {op: n / steps for op, n in counted.items()}
        if rank == 0:  # one JSON line
            print(json.dumps({"init_diff": init_diff, "max_diff": diff, "bytes_per_step": moved}))
        assert init_diff == 0.0 and diff <= 1e-5, (init_diff, diff)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
