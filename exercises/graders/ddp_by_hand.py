"""Grader of exercises/ddp_by_hand.py: 2 ranks, a model with a frozen layer and a tied weight, different
initial weights and data per rank; against torch's DDP; the all-reduces counted and timed against backward."""
from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from exercises.graders._common import max_abs_diff, rank_failures

WORLD_SIZE = 2
FUNCTIONS = ["DataParallelByHand"]
STEPS = 3
# 20 float64 values: the rule makes 3 buckets of this model: [head], [out.bias, the tied weight], [inp.bias]
CAP_MB = 20 * 8 / 2 ** 20


class TiedNet(nn.Module):
    """inp (6 -> 6) -> frozen mid (6 -> 6) -> out (6 -> 6, its weight IS inp's) -> head (6 -> 3), and a
    buffer."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.out.weight = self.inp.weight  # tied: one parameter used twice
        self.mid.requires_grad_(False)     # frozen
        self.register_buffer("scale", torch.ones(6))

    def forward(self, x):
        return self.head(torch.tanh(self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))) * self.scale)


def make_model(rank: int) -> nn.Module:
    torch.manual_seed(rank)  # a different init on every rank: the wrapper must broadcast rank 0's
    model = TiedNet().double()
    model.scale.fill_(1.0 + rank)
    return model


def expected_buckets(model: nn.Module, cap_mb: float | None) -> int:
    params = [p for p in model.parameters() if p.requires_grad][::-1]
    if cap_mb is None:
        return len(params)
    count, size = 0, 0
    for p in params:
        size += p.numel() * p.element_size()
        if size >= cap_mb * 2 ** 20:
            count, size = count + 1, 0
    return count + (1 if size else 0)


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)


def train(model, after_backward, log=None) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    for step in range(STEPS):
        x, y = batch(step, dist.get_rank())
        if log is not None:
            log.append(("backward", step))
        nn.functional.cross_entropy(model(x), y).backward()
        if log is not None:
            log.append(("backward_done", step))
        after_backward()
        opt.step()
        opt.zero_grad()
    return [t.detach().tolist() for t in list(model.parameters()) + list(model.buffers())]


def by_hand(module: str, cap_mb) -> dict:
    wrapper_class = importlib.import_module(module).DataParallelByHand
    model = make_model(dist.get_rank())
    wrapped = wrapper_class(model, bucket_cap_mb=cap_mb)
    log: list = []
    original = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        log.append(("all_reduce", bool(kwargs.get("async_op", False) or (len(args) >= 3 and args[2]))))
        return original(tensor, *args, **kwargs)

    model.inp.bias.register_post_accumulate_grad_hook(lambda p: log.append(("first_layer_grad",)))
    dist.all_reduce = recording
    try:
        final = train(wrapped, wrapped.finish_gradient_sync, log)
    finally:
        dist.all_reduce = original
    return {"final": final, "log": log, "expected_buckets": expected_buckets(model, cap_mb)}


def on_rank(module: str) -> dict:
    reference = train(DDP(make_model(dist.get_rank())), lambda: None)
    return {"ddp": reference, "per_gradient": by_hand(module, None), "buckets": by_hand(module, CAP_MB)}


def _per_backward(log: list) -> list[list]:
    """The all-reduce entries between each ('backward', step) and the next one, and whether backward was
    still running (the first layer's gradient not yet accumulated) when the first of them started."""
    out, current = [], None
    for entry in log:
        if entry[0] == "backward":
            current = {"calls": [], "overlapped": False, "first_done": False}
            out.append(current)
        elif entry[0] == "first_layer_grad" and current is not None:
            current["first_done"] = True
        elif entry[0] == "all_reduce" and current is not None:
            current["calls"].append(entry[1])
            if len(current["calls"]) == 1 and not current["first_done"]:
                current["overlapped"] = True
    return out


def _problem(mode: str, rank: int, run: dict, reference: list) -> str | None:
    """The first thing wrong with one rank's run in one mode, or None."""
    diff = max(max_abs_diff(g, w) for g, w in zip(run["final"], reference))
    if not diff <= 1e-12:
        return (f"rank {rank}'s parameters and buffers differ from DDP's by {diff:.2e} after {STEPS} steps: "
                f"broadcast rank 0's parameters and buffers at wrap time (frozen ones too) and average "
                f"(sum / world size) each gradient once")
    unit = "trainable parameter" if mode == "per_gradient" else "bucket"
    for step, b in enumerate(_per_backward(run["log"])):
        if len(b["calls"]) != run["expected_buckets"]:
            return (f"rank {rank} made {len(b['calls'])} all-reduces in backward {step}, expected "
                    f"{run['expected_buckets']} (one per {unit}; a tied parameter counts once)")
        if not all(b["calls"]):
            return (f"rank {rank} called dist.all_reduce without async_op=True: the work must run while "
                    f"backward goes on")
        if not b["overlapped"]:
            return (f"rank {rank}'s first all-reduce started after backward had finished: launch it from the "
                    f"gradient hook, as soon as the bucket's gradients are ready")
    return None


def judge(answers: list) -> list[str]:
    problems = rank_failures(answers)
    if problems:
        return problems
    for mode, what in (("per_gradient", "bucket_cap_mb=None"), ("buckets", f"bucket_cap_mb={CAP_MB:.6f}")):
        for rank, a in enumerate(answers):
            problem = _problem(mode, rank, a[mode], a["ddp"])
            if problem:
                return [f"{what}: {problem}"]
    return []
