"""Minimal 18: gradient compression -- a hand-written fp16 comm hook against PyTorch's, PowerSGD resumed.

    torchrun --standalone --nproc_per_node=2 minimal/18_gradient_compression.py
    python minimal/18_gradient_compression.py                       # plain python: a world of one

A DDP hook gets each bucket: ours sends fp16, bit for bit PyTorch's; PowerSGD resumes only with its state."""

import copy
import json
import os
import pickle

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

SENT = []  # bytes our hook hands to the all-reduce


def fp16_hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()  # the bucket's fp32 gradients, flat
    compressed = buffer.to(torch.float16).div_(group.size())  # divide first: a sum may overflow
    SENT.append(compressed.numel() * compressed.element_size())
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()
    return fut.then(lambda fut: buffer.copy_(fut.value()[0]))  # back to fp32, in place


def build(device, seed=0):
    torch.manual_seed(seed)
    raw = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    return raw, DDP(raw, bucket_cap_mb=100)  # one bucket: under gloo PowerSGD needs it


def gradient_with(hook, state, x, y):
    raw, model = build(x.device)
    model.register_comm_hook(state, hook)
    F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in raw.parameters()])


def powersgd_state():
    return powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)


def train(model, opt, batches):
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def resume(ckpt, batches, hook_state: bool):
    raw, model = build(batches[0][0].device, seed=1)  # another start: only the checkpoint matters
    raw.load_state_dict(ckpt["model"])
    opt = torch.optim.SGD(raw.parameters(), lr=0.05, momentum=0.9)
    opt.load_state_dict(copy.deepcopy(ckpt["optimizer"]))
    state = pickle.loads(ckpt["hook_state"]) if hook_state else powersgd_state()
    plain = [True]  # one plain backward first: DDP rebuilds its bucket in arrival order

    def resumed_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if plain[0]:
            return default_hooks.allreduce_hook(None, bucket)
        return powerSGD_hook.powerSGD_hook(state, bucket)

    model.register_comm_hook(state, resumed_hook)
    F.cross_entropy(model(batches[0][0]), batches[0][1]).backward()  # its gradients are thrown away
    opt.zero_grad()
    plain[0] = False
    train(model, opt, batches)
    return raw


def main():
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # the device on this node; RANK is global
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: NCCL binds this process to its GPU
    if "RANK" not in os.environ:  # plain python: what torchrun would set, for a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT="0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # reads those variables
    assert dist.get_world_size() == world_size
    try:
        torch.manual_seed(100 + rank)  # each rank its own samples, drawn on the CPU
        batches = [(torch.randn(32, 64), torch.randint(10, (32,))) for _ in range(8)]
        batches = [(x.to(device), y.to(device)) for x, y in batches]
        ours = gradient_with(fp16_hook, None, *batches[0])
        pytorchs = gradient_with(default_hooks.fp16_compress_hook, None, *batches[0])
        plain = gradient_with(default_hooks.allreduce_hook, None, *batches[0])
        raw, model = build(device)
        state = powersgd_state()
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        opt = torch.optim.SGD(raw.parameters(), lr=0.05, momentum=0.9)
        train(model, opt, batches[:4])  # steps 1-2 plain, 3-4 compressed
        powersgd_numbers = state.total_numel_after_compression // 2  # per compressed step
        ckpt = copy.deepcopy({"model": raw.state_dict(), "optimizer": opt.state_dict()})
        ckpt["hook_state"] = pickle.dumps(state)  # error_dict, p/q_memory_dict, rng, iter
        train(model, opt, batches[4:])  # the uninterrupted run
        out = {
            "fp16_vs_pytorch": (ours - pytorchs).abs().max().item(),
            "fp16_error": ((ours - plain).abs().max() / plain.abs().max()).item(),
            "fp16_bytes": SENT[0],
            "powersgd_numbers": powersgd_numbers,
        }
        for key, with_state in (("resume_exact", True), ("resume_without_hook_state", False)):
            resumed = resume(ckpt, batches[4:], with_state)
            diffs = [(a - b).abs().max() for a, b in zip(resumed.parameters(), raw.parameters())]
            out[key] = torch.stack(diffs).max().item()  # NaN if either run diverged
        if rank == 0:
            print(json.dumps(out))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
