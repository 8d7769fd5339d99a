"""Grader of exercises/tp_decode_step.py: 2 ranks, each with half the heads and their cache, against unsplit
attention over the whole cache in one process (float64)."""

from __future__ import annotations

import importlib
import math

import torch

from exercises.graders._common import answer_diff, rank_failures

WORLD_SIZE = 2
FUNCTIONS = ["decode_step"]
B, D, HEADS, MAX_LEN, POS = 2, 16, 4, 8, 5
HD = D // HEADS


def inputs() -> dict:
    """The whole layer and a cache holding positions 0 .. POS-1, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(0)
    t = {n: torch.randn(D, D, generator=g, dtype=torch.float64) / 4 for n in ("q", "k", "v", "o")}
    t["x"] = torch.randn(B, D, generator=g, dtype=torch.float64)
    for n in ("cache_k", "cache_v"):
        t[n] = torch.zeros(B, HEADS, MAX_LEN, HD, dtype=torch.float64)
        t[n][:, :, :POS] = torch.randn(B, HEADS, POS, HD, generator=g, dtype=torch.float64)
    return t


def unsplit() -> dict:
    """One process, every head: the new k, v (B, HEADS, HD) and the output (B, D)."""
    t = inputs()
    q, k, v = ((t["x"] @ t[n].T).view(B, HEADS, 1, HD) for n in ("q", "k", "v"))
    keys = torch.cat([t["cache_k"][:, :, :POS], k], 2)
    values = torch.cat([t["cache_v"][:, :, :POS], v], 2)
    y = ((q @ keys.transpose(-2, -1) / math.sqrt(HD)).softmax(-1) @ values).reshape(B, D)
    heads = y.view(B, HEADS, HD)
    return {"k": k[:, :, 0], "v": v[:, :, 0], "out": y @ t["o"].T, "heads": heads, "t": t}


def on_rank(module: str) -> dict:
    import torch.distributed as dist

    decode_step = importlib.import_module(module).decode_step
    rank, tp = dist.get_rank(), dist.get_world_size()
    t, h = inputs(), HEADS // tp
    rows = slice(rank * D // tp, (rank + 1) * D // tp)
    cache_k = t["cache_k"][:, rank * h : (rank + 1) * h].clone()
    cache_v = t["cache_v"][:, rank * h : (rank + 1) * h].clone()
    args = [t["q"][rows], t["k"][rows], t["v"][rows], t["o"][:, rows]]
    out = decode_step(t["x"].clone(), *args, cache_k, cache_v, POS)
    return {"out": out.tolist(), "cache_k": cache_k.tolist(), "cache_v": cache_v.tolist()}


def judge(answers: list) -> list[str]:
    problems = rank_failures(answers)
    if problems:
        return problems
    want, tp = unsplit(), len(answers)
    h = HEADS // tp
    for rank, a in enumerate(answers):
        mine = slice(rank * h, (rank + 1) * h)
        for name in ("k", "v"):
            got = torch.tensor(a[f"cache_{name}"], dtype=torch.float64)
            if not answer_diff(got[:, :, POS], want[name][:, mine]) <= 1e-10:
                return [
                    f"rank {rank}: cache_{name}[:, :, {POS}] is not this token's {name} of heads "
                    f"{mine.start}..{mine.stop - 1}: write x @ w{name}.T, viewed as (B, heads, 1, hd), "
                    f"at position pos"
                ]
            before = want["t"][f"cache_{name}"][:, mine]
            others = [p for p in range(MAX_LEN) if p != POS]
            if not answer_diff(got[:, :, others], before[:, :, others]) <= 0:
                return [
                    f"rank {rank}: cache_{name} changed at positions other than pos = {POS}: write "
                    f"the new token's slot only (the earlier tokens' entries are already right)"
                ]
        out = torch.tensor(a["out"], dtype=torch.float64)
        if answer_diff(out, want["out"]) <= 1e-10:  # NaN fails
            continue
        t = want["t"]
        rows = slice(rank * D // tp, (rank + 1) * D // tp)
        partial = want["heads"][:, mine].reshape(B, -1) @ t["o"][:, rows].T
        if answer_diff(out, partial) <= 1e-10:
            return [
                f"rank {rank}: the output is this rank's heads' share only: all-reduce (sum) the "
                f"partial outputs of the ranks (each holds {h} of the {HEADS} heads)"
            ]
        return [
            f"rank {rank}: the output differs from unsplit attention by {answer_diff(out, want['out']):.2e}: "
            f"attend to positions 0..pos only (the slots after pos are empty), scale by sqrt(hd)"
        ]
    return []
