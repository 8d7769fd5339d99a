"""Minimal 18: gradient compression -- a hand-written fp16 comm hook against PyTorch's, PowerSGD resumed.

    torchrun --standalone --nproc_per_node=2 minimal/18_gradient_compression.py

DDP hands each gradient bucket (a GradBucket: one flat buffer) to the hook and writes the value of the Future
it returns into .grad. Ours sends fp16, half the bytes, equal to default_hooks.fp16_compress_hook bit for bit.
PowerSGD's state (error feedback, warm-start P and Q, RNG, step count) is training state: a resumed run equals
the uninterrupted one only with it. Lesson: lessons/18_gradient_compression.py.
"""

import copy
import json
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
    # divide first: the sum of fp16 values may overflow (65504) where their mean does not
    compressed = buffer.to(torch.float16).div_(group.size())
    SENT.append(compressed.numel() * compressed.element_size())
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()
    return fut.then(lambda fut: buffer.copy_(fut.value()[0]))  # back to fp32, in place


def build(seed=0):
    torch.manual_seed(seed)
    raw = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    return raw, DDP(raw, bucket_cap_mb=100)  # one bucket: under gloo PowerSGD needs it


def gradient_with(hook, state, x, y):
    raw, model = build()
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
    raw, model = build(seed=1)  # another start: only what the checkpoint holds may matter
    raw.load_state_dict(ckpt["model"])
    opt = torch.optim.SGD(raw.parameters(), lr=0.05, momentum=0.9)
    opt.load_state_dict(copy.deepcopy(ckpt["optimizer"]))
    state = pickle.loads(ckpt["hook_state"]) if hook_state else powersgd_state()
    plain = [
        True
    ]  # one plain backward first: DDP rebuilds its bucket in the order gradients arrive

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
    dist.init_process_group("gloo")  # CPU tensors: NCCL would need them on the GPU
    rank = dist.get_rank()
    try:
        torch.manual_seed(100 + rank)  # each rank its own samples
        batches = [(torch.randn(32, 64), torch.randint(10, (32,))) for _ in range(8)]
        ours = gradient_with(fp16_hook, None, *batches[0])
        pytorchs = gradient_with(default_hooks.fp16_compress_hook, None, *batches[0])
        plain = gradient_with(default_hooks.allreduce_hook, None, *batches[0])
        raw, model = build()
        state = powersgd_state()
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        opt = torch.optim.SGD(raw.parameters(), lr=0.05, momentum=0.9)
        train(model, opt, batches[:4])  # steps 1-2 plain, 3-4 compressed
        powersgd_numbers = state.total_numel_after_compression // 2  # per compressed step
        ckpt = {
            "model": copy.deepcopy(raw.state_dict()),
            "optimizer": copy.deepcopy(opt.state_dict()),
        }
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
