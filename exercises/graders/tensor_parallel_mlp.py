"""Grader of exercises/tensor_parallel_mlp.py: 2 ranks against the unsplit MLP, forward and backward."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from exercises.graders._common import answer_diff, rank_failures

WORLD_SIZE = 2
FUNCTIONS = ["CopyToParallel", "ReduceFromParallel", "TensorParallelMLP"]
D, H, B = 4, 8, 5


def layers() -> tuple[nn.Linear, nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(D, H).double(), nn.Linear(H, D).double()
    x = torch.randn(B, D, dtype=torch.float64)
    target = torch.randn(B, D, dtype=torch.float64)
    return fc1, fc2, x, target


def unsplit() -> dict:
    fc1, fc2, x, target = layers()
    x.requires_grad_(True)
    out = fc2(nn.functional.gelu(fc1(x)))
    ((out - target) ** 2).sum().backward()
    return {
        "out": out.detach(),
        "dx": x.grad,
        "w1": fc1.weight.grad,
        "b1": fc1.bias.grad,
        "w2": fc2.weight.grad,
        "b2": fc2.bias.grad,
    }


def on_rank(module: str) -> dict:
    mlp_class = importlib.import_module(module).TensorParallelMLP
    fc1, fc2, x, target = layers()
    mlp = mlp_class(fc1, fc2)
    x.requires_grad_(True)
    out = mlp(x)
    ((out - target) ** 2).sum().backward()
    grads = {
        name: (p.grad.tolist() if p.grad is not None else None)
        for name, p in [("w1", mlp.w1), ("b1", mlp.b1), ("w2", mlp.w2), ("b2", mlp.b2)]
    }
    return {
        "out": out.detach().tolist(),
        "dx": x.grad.tolist() if x.grad is not None else None,
        **grads,
    }


def judge(answers: list) -> list[str]:
    problems = rank_failures(answers)
    if problems:
        return problems
    want, tp = unsplit(), len(answers)
    part = H // tp
    for rank, a in enumerate(answers):
        rows = slice(rank * part, (rank + 1) * part)
        if not answer_diff(a["out"], want["out"]) <= 1e-10:  # NaN fails too
            diff = answer_diff(a["out"], want["out"])
            return [
                f"rank {rank}: output differs from the unsplit MLP by {diff:.2e}"
                f": all-reduce the row-parallel partial outputs (g), then add b2 once"
            ]
        if a["dx"] is None or not answer_diff(a["dx"], want["dx"]) <= 1e-10:
            return [
                f"rank {rank}: the input's gradient differs from the unsplit MLP's: f's backward must "
                f"all-reduce it (each rank's half of the hidden units contributes part of dL/dx)"
            ]
        expected = {
            "w1": want["w1"][rows],
            "b1": want["b1"][rows],
            "w2": want["w2"][:, rows],
            "b2": want["b2"],
        }
        for name, value in expected.items():
            if a[name] is None or not answer_diff(a[name], value) <= 1e-10:
                return [
                    f"rank {rank}: the gradient of {name} is not the matching slice of the unsplit "
                    f"layer's "
                    f"(rows {rows.start}..{rows.stop - 1} for w1/b1, those columns for w2, all of b2)"
                ]
    return []
