"""Grader of exercises/accumulation.py: 2 ranks x 4 micro-batches of 5, 5, 5 and 1 samples against one step
on the global batch."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.measure.differences import nan_max
from exercises.graders._common import answer_diff, rank_failures

WORLD_SIZE = 2
FUNCTIONS = ["accumulation_step"]
MICRO, STEPS = (5, 5, 5, 1), 2  # per rank per step: micro-batches of these sizes; 2 optimizer steps
K = len(MICRO)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def batch(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + micro)
    size = MICRO[micro]
    return torch.randn(size, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (size,), generator=g
    )


def reference_params(rule: str = "global mean") -> list[torch.Tensor]:
    """One process, one SGD step per step. "global mean": the mean loss over all ranks' micro-batches at once
    (the global batch, what the answer must equal); the rules a learner may use instead: "mean / k" (each
    micro-batch's mean divided by k, lesson 07's rule for equal micro-batches), "mean" (not divided)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        opt.zero_grad()
        if rule == "global mean":
            xs, ys = zip(*[batch(step, r, m) for r in range(WORLD_SIZE) for m in range(K)])
            nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        else:
            for r in range(
                WORLD_SIZE
            ):  # DDP: the mean over ranks of each rank's accumulated gradient
                for m in range(K):
                    x, y = batch(step, r, m)
                    loss = nn.functional.cross_entropy(model(x), y) / WORLD_SIZE
                    (loss / K if rule == "mean / k" else loss).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def on_rank(module: str) -> dict:
    step_fn = importlib.import_module(module).accumulation_step
    ddp = DDP(make_model())
    calls = []

    def counting_hook(state, bucket):  # DDP's default all-reduce (averaging), counted
        calls.append(bucket.index())
        fut = dist.all_reduce(
            bucket.buffer().div_(dist.get_world_size()), async_op=True
        ).get_future()
        return fut.then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, counting_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    per_step = []
    for step in range(STEPS):
        before = len(calls)
        step_fn(ddp, opt, [batch(step, dist.get_rank(), m) for m in range(K)])
        per_step.append(len(calls) - before)
    return {
        "all_reduces": per_step,
        "params": [p.detach().tolist() for p in ddp.module.parameters()],
    }


def judge(answers: list) -> list[str]:
    problems = rank_failures(answers)
    if problems:
        return problems
    want = reference_params()
    for rank, a in enumerate(answers):
        if (
            a["all_reduces"] != [1] * STEPS
        ):  # the model is one bucket: one all-reduce per optimizer step
            return [
                f"rank {rank}: DDP all-reduced {a['all_reduces']} times per optimizer step, expected 1: "
                f"run "
                f"the forward and backward of the first k - 1 micro-batches inside ddp_model.no_sync()"
            ]
        diff = nan_max(answer_diff(g, w) for g, w in zip(a["params"], want))
        if not diff <= 1e-10:
            ratio = _ratio_hint(a["params"])
            return [
                f"rank {rank}: parameters differ from one step on the global batch by {diff:.2e}{ratio}"
            ]
    return []


def _ratio_hint(params) -> str:
    """Which rule the update follows, if one a learner may use instead."""
    if max(answer_diff(g, w) for g, w in zip(params, reference_params("mean / k"))) <= 1e-10:
        return (
            f": that is each micro-batch's mean loss divided by k = {K}, right only when the "
            f"micro-batches are equal: with sizes {list(MICRO)} the 1-sample one weighs as much as a "
            f"5-sample one; divide each sample's loss by the rank's {sum(MICRO)} samples "
            f"(reduction='sum' / {sum(MICRO)})"
        )
    if max(answer_diff(g, w) for g, w in zip(params, reference_params("mean"))) <= 1e-10:
        return (
            f": that is the sum of the {K} micro-batches' mean losses, about {K}x the right update: each "
            f"backward adds into .grad; divide each sample's loss by the rank's {sum(MICRO)} samples"
        )
    return (
        ": check the loss (each sample's cross-entropy / the rank's samples), the step and zero_grad "
        "once per accumulation_step"
    )
