"""Grader of exercises/library_lines.py: 2 ranks, 2 epochs of 48 samples in micro-batches of 4, k = 3, against
one process stepping on each global batch of DistributedSampler's shards; which samples each rank read, and
DDP's all-reduces per optimizer step."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from common.measure.differences import nan_max
from exercises.graders._common import answer_diff, rank_failures

WORLD_SIZE = 2
FUNCTIONS = ["prepare", "train_epoch"]
N, B, K, EPOCHS, SEED, LR = 48, 4, 3, 2, 7, 0.5  # 48 / 2 ranks / 4 = 6 micro-batches: 2 steps of 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


class Recorded(TensorDataset):
    """The grader's dataset: it remembers the index of every sample a rank reads."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(N, 6, generator=g, dtype=torch.float64)
        super().__init__(x, torch.randint(0, 3, (N,), generator=g))
        self.read: list[int] = []

    def __getitem__(self, i):
        self.read.append(int(i))
        return super().__getitem__(i)


def shards(epoch: int) -> list[list[int]]:
    """Each rank's order in `epoch`, as DistributedSampler(seed=SEED) after set_epoch(epoch) gives it."""
    out = []
    for r in range(WORLD_SIZE):
        s = DistributedSampler(range(N), WORLD_SIZE, r, shuffle=True, seed=SEED)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def reference_params(divide: bool = True) -> list[torch.Tensor]:
    """One process: per optimizer step, the mean loss over every rank's K micro-batches at once (divide);
    or each micro-batch's mean loss not divided by K (the update about K times too large)."""
    model, data = make_model(), Recorded()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for epoch in range(EPOCHS):
        orders = shards(epoch)
        for step in range(len(orders[0]) // (B * K)):
            idx = [i for o in orders for i in o[step * B * K : (step + 1) * B * K]]
            x, y = data.tensors[0][idx], data.tensors[1][idx]
            loss = nn.functional.cross_entropy(model(x), y)
            (loss if divide else loss * K).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def on_rank(module: str) -> dict:
    learner = importlib.import_module(module)
    data = Recorded()
    ddp, loader = learner.prepare(make_model(), data, B, SEED)
    calls = []

    def counting_hook(state, bucket):  # DDP's default all-reduce (averaging), counted
        calls.append(bucket.index())
        fut = dist.all_reduce(
            bucket.buffer().div_(dist.get_world_size()), async_op=True
        ).get_future()
        return fut.then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, counting_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    read = []
    for epoch in range(EPOCHS):
        data.read.clear()
        learner.train_epoch(ddp, opt, loader, epoch, K)
        read.append(list(data.read))
    return {
        "read": read,
        "all_reduces": len(calls),
        "params": [p.detach().tolist() for p in ddp.module.parameters()],
    }


def judge(answers: list) -> list[str]:
    problems = rank_failures(answers)
    if problems:
        return problems
    steps = EPOCHS * N // (WORLD_SIZE * B * K)
    for rank, a in enumerate(answers):
        want = [shards(e)[rank] for e in range(EPOCHS)]
        if a["read"][0] == answers[1 - rank]["read"][0] or sorted(a["read"][0]) != sorted(want[0]):
            return [
                f"rank {rank} read samples {a['read'][0][:6]}... in epoch 0, expected its shard "
                f"{want[0][:6]}...: both ranks must read disjoint halves; use "
                f"DistributedSampler(dataset, world_size, rank, shuffle=True, seed=seed)"
            ]
        if a["read"][1] != want[1]:
            same = a["read"][1] == a["read"][0]
            why = "the order of epoch 0 again" if same else "another order"
            return [
                f"rank {rank} read {why} in epoch 1: call loader.sampler.set_epoch(epoch) before each "
                f"pass (Fabric's loader does it for you; a plain DataLoader does not)"
            ]
        if a["all_reduces"] != steps:
            return [
                f"rank {rank}: DDP all-reduced {a['all_reduces']} times in {steps} optimizer steps: "
                f"run the first k - 1 micro-batches' forward and backward inside ddp_model.no_sync()"
            ]
        diff = nan_max(answer_diff(g, w) for g, w in zip(a["params"], reference_params()))
        if not diff <= 1e-10:
            return [f"rank {rank}: parameters differ from the global steps by {diff:.2e}{hint(a)}"]
    return []


def hint(answer: dict) -> str:
    """Which mistake the parameters show, if a known one."""
    undivided = reference_params(divide=False)
    if nan_max(answer_diff(g, w) for g, w in zip(answer["params"], undivided)) <= 1e-10:
        return (
            f": that is each micro-batch's mean loss not divided by k = {K}, a {K}x update; "
            "fabric.backward(loss) is loss.backward() (only accelerator.backward divides by k)"
        )
    return ": check the loss (the micro-batch's mean / k), the step and zero_grad every k micro-batches"
