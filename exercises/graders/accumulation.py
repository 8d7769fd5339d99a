"""Grader of exercises/accumulation.py: 2 ranks x 4 micro-batches against one step on the global batch."""
from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.differences import nan_max
from exercises.graders._common import max_abs_diff, rank_failures

WORLD_SIZE = 2
FUNCTIONS = ["accumulation_step"]
K, MICRO, STEPS = 4, 3, 2  # 4 micro-batches of 3 samples per rank per step, 2 optimizer steps


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def batch(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + micro)
    return torch.randn(MICRO, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (MICRO,), generator=g)


def reference_params() -> list[torch.Tensor]:
    """One process, one SGD step per step on all ranks' micro-batches at once (the global batch)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        xs, ys = zip(*[batch(step, r, m) for r in range(WORLD_SIZE) for m in range(K)])
        loss = nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def on_rank(module: str) -> dict:
    step_fn = importlib.import_module(module).accumulation_step
    ddp = DDP(make_model())
    calls = []

    def counting_hook(state, bucket):  # DDP's default all-reduce (averaging), counted
        calls.append(bucket.index())
        fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, counting_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    per_step = []
    for step in range(STEPS):
        before = len(calls)
        step_fn(ddp, opt, [batch(step, dist.get_rank(), m) for m in range(K)])
        per_step.append(len(calls) - before)
    return {"all_reduces": per_step, "params": [p.detach().tolist() for p in ddp.module.parameters()]}


def judge(answers: list) -> list[str]:
    problems = rank_failures(answers)
    if problems:
        return problems
    want = reference_params()
    for rank, a in enumerate(answers):
        if a["all_reduces"] != [1] * STEPS:  # the model is one bucket: one all-reduce per optimizer step
            return [f"rank {rank}: DDP all-reduced {a['all_reduces']} times per optimizer step, expected 1: "
                    f"run "
                    f"the forward and backward of the first k - 1 micro-batches inside ddp_model.no_sync()"]
        diff = nan_max(max_abs_diff(g, w) for g, w in zip(a["params"], want))
        if not diff <= 1e-10:
            ratio = _ratio_hint(a["params"])
            return [f"rank {rank}: parameters differ from one step on the global batch by {diff:.2e}{ratio}"]
    return []


def _ratio_hint(params) -> str:
    """If the update is k times the right one, the loss was not divided by k."""
    start = [p.detach() for p in make_model().parameters()]
    want = reference_params()
    got_step = torch.cat([(torch.tensor(g) - s).flatten() for g, s in zip(params, start)])
    want_step = torch.cat([(w - s).flatten() for w, s in zip(want, start)])
    ratio = (got_step.norm() / want_step.norm()).item()
    if abs(ratio - K) < 0.5:
        return f": your update is about {ratio:.1f}x the right one: divide each micro-batch's loss by k = {K}"
    return ": check the loss (mean cross-entropy / k), the step and zero_grad once per accumulation_step"
