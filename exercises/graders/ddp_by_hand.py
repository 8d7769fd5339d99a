"""Grader of exercises/ddp_by_hand.py: 3 ranks, a model with a frozen layer and a tied weight, different
initial weights and data per rank; against torch's DDP; the all-reduces counted and timed against backward."""
from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.differences import nan_max
from exercises.graders._common import functions_replaced, max_abs_diff, rank_failures

WORLD_SIZE = 3  # 3, not 2: an average hard-coded as x 0.5, or (sum of sums) / 2W, is right only at 2
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


class _Watched:
    """An all-reduce's work that logs when it is waited on (everything else goes to the real work)."""

    def __init__(self, work, index: int, log: list):
        self._work, self._index, self._log = work, index, log

    def wait(self, *args, **kwargs):
        self._log.append(("wait", self._index))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def by_hand(module: str, cap_mb) -> dict:
    learner = importlib.import_module(module)
    model = make_model(dist.get_rank())
    wrapped = learner.DataParallelByHand(model, bucket_cap_mb=cap_mb)
    log: list = []
    original = c10d.all_reduce

    def recording(tensor, *args, **kwargs):
        async_op = bool(kwargs.get("async_op", False) or (len(args) >= 3 and args[2]))
        index = sum(1 for e in log if e[0] == "all_reduce")
        log.append(("all_reduce", async_op, index))
        work = original(tensor, *args, **kwargs)
        return _Watched(work, index, log) if async_op and work is not None else work

    model.inp.bias.register_post_accumulate_grad_hook(lambda p: log.append(("first_layer_grad",)))
    # every way to the all-reduce is counted: dist.all_reduce, distributed_c10d's, a name bound at import
    with functions_replaced({original: recording}, [learner]):
        final = train(wrapped, wrapped.finish_gradient_sync, log)
    return {"final": final, "log": log, "expected_buckets": expected_buckets(model, cap_mb)}


def on_rank(module: str) -> dict:
    reference = train(DDP(make_model(dist.get_rank())), lambda: None)
    return {"ddp": reference, "per_gradient": by_hand(module, None), "buckets": by_hand(module, CAP_MB)}


def _per_backward(log: list) -> list[dict]:
    """The all-reduce entries between each ('backward', step) and the next one; whether backward was still
    running (the first layer's gradient not yet accumulated) when the first of them started; and whether one
    started while an earlier one of the same backward was not waited on yet (the works overlap backward)."""
    out, current = [], None
    for entry in log:
        if entry[0] == "backward":
            current = {"calls": [], "overlapped": False, "first_done": False, "pending": set(),
                       "concurrent": False}
            out.append(current)
        elif current is None:
            continue
        elif entry[0] == "first_layer_grad":
            current["first_done"] = True
        elif entry[0] == "wait":
            current["pending"].discard(entry[1])
        elif entry[0] == "all_reduce":
            current["calls"].append(entry[1])
            current["concurrent"] |= bool(current["pending"])
            current["pending"].add(entry[2])
            if len(current["calls"]) == 1 and not current["first_done"]:
                current["overlapped"] = True
    return out


def _problem(mode: str, rank: int, run: dict, reference: list) -> str | None:
    """The first thing wrong with one rank's run in one mode, or None."""
    unit = "trainable parameter" if mode == "per_gradient" else "bucket"
    per_backward = _per_backward(run["log"])
    for step, b in enumerate(per_backward):
        if len(b["calls"]) != run["expected_buckets"]:
            return (f"rank {rank} made {len(b['calls'])} all-reduces in backward {step}, expected "
                    f"{run['expected_buckets']} (one per {unit}, each gradient all-reduced once; a tied "
                    f"parameter counts once)")
    diff = nan_max(max_abs_diff(g, w) for g, w in zip(run["final"], reference))
    if not diff <= 1e-12:
        return (f"rank {rank}'s parameters and buffers differ from DDP's by {diff:.2e} after {STEPS} steps: "
                f"broadcast rank 0's parameters and buffers at wrap time (frozen ones too) and average "
                f"(sum / world size) each gradient once; this run has {WORLD_SIZE} ranks: divide by "
                f"dist.get_world_size(), never by a fixed number")
    for b in per_backward:
        if not all(b["calls"]):
            return (f"rank {rank} called dist.all_reduce without async_op=True: the work must run while "
                    f"backward goes on")
        if not b["overlapped"]:
            return (f"rank {rank}'s first all-reduce started after backward had finished: launch it from the "
                    f"gradient hook, as soon as the bucket's gradients are ready")
        if len(b["calls"]) > 1 and not b["concurrent"]:
            return (f"rank {rank} waited on each all-reduce before the next gradient hook launched another: "
                    f"backward stalls on every {unit}; keep the works and wait for them in "
                    f"finish_gradient_sync")
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
