"""Grader of exercises/moe_dispatch.py: send counts and the send order of expert parallelism's dispatch,
graded in one process against the lesson's plan (common.expert_parallel.moe's, without a capacity mask)."""

from __future__ import annotations

import importlib
import itertools

import torch

WORLD_SIZE = 0
FUNCTIONS = ["dispatch_plan"]
CASES = list(itertools.product((0, 1, 7, 40), ((4, 1), (4, 2), (4, 4), (8, 2), (6, 3)), (0, 1)))


def _want(expert_of: torch.Tensor, experts: int, ep: int) -> tuple[list, list]:
    order = torch.argsort(expert_of, stable=True)
    return torch.bincount(expert_of // (experts // ep), minlength=ep).tolist(), order.tolist()


def _counts_problem(got: list, want: list, expert_of: torch.Tensor, experts: int, ep: int) -> str:
    if len(got) == experts != ep:
        return (
            f"send_counts has one entry per expert ({experts}); all_to_all_single wants one per "
            f"destination rank (ep = {ep}): add up the rows for the experts each rank holds"
        )
    if len(got) != ep:
        return (
            f"send_counts has {len(got)} entries, expected ep = {ep} (one per rank, 0 for a rank that "
            f"gets no row: bincount's minlength)"
        )
    if got == torch.bincount(expert_of % ep, minlength=ep).tolist() != want:
        return (
            f"that is expert e on rank e % ep; rank d holds the contiguous block d*E/ep .. "
            f"(d+1)*E/ep - 1, so expert e lives on rank e // (E/ep) = e // {experts // ep}"
        )
    return "send_counts[d] must count the rows whose expert lives on rank d"


def _order_problem(got: list, expert_of: torch.Tensor, experts: int, ep: int) -> str:
    if sorted(got) != list(range(len(expert_of))):
        return f"order must be a permutation of 0..{len(expert_of) - 1}: every row is sent exactly once"
    sent = expert_of[torch.tensor(got, dtype=torch.long)]
    ranks = (sent // (experts // ep)).tolist()
    if ranks != sorted(ranks):
        return (
            "rows must be grouped by destination rank, in rank order: all of rank 0's first, then "
            "rank 1's"
        )
    if sent.tolist() != sorted(sent.tolist()):
        return (
            "within a destination rank, sort the rows by expert: the receiver runs each expert on a "
            "contiguous run"
        )
    return (
        "rows with the same expert must keep their original order: a stable sort "
        "(torch.argsort(stable=True))"
    )


def _not_integer(value) -> str:
    """'' for an integer tensor (or a list of ints), else what it holds instead (e.g. 'torch.float32')."""
    if torch.is_tensor(value):
        dtype = value.dtype
        return (
            str(dtype) if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool else ""
        )
    bad = [v for v in list(value) if isinstance(v, bool) or not isinstance(v, int)]
    return f"a list holding {type(bad[0]).__name__}s" if bad else ""


def check(module: str) -> list[str]:
    plan = importlib.import_module(module).dispatch_plan
    for m, (experts, ep), seed in CASES:
        g = torch.Generator().manual_seed(seed)
        expert_of = torch.randint(experts, (m,), generator=g)
        if seed:  # a skewed routing: the last experts (and ranks) get nothing
            expert_of = expert_of % max(1, experts // 2)
        want_counts, want_order = _want(expert_of, experts, ep)
        counts, order = plan(expert_of.clone(), experts, ep)
        case = f"expert_of={expert_of.tolist()[:12]}{'...' if m > 12 else ''} (M={m}), E={experts}, ep={ep}"
        for what, value, use in (
            ("send_counts", counts, "all_to_all_single's split sizes are"),
            ("order", order, "x[order] needs"),
        ):
            kind = _not_integer(value)
            if kind:
                return [
                    f"{case}: {what} is {kind}: {use} integers (2.0 == 2 in Python, but a float is "
                    f"neither a split size nor an index): return int64, as torch.bincount and "
                    f"torch.argsort do"
                ]
        got_counts, got_order = torch.as_tensor(counts).tolist(), torch.as_tensor(order).tolist()
        if got_counts != want_counts:
            return [
                f"{case}: send_counts {got_counts}, expected {want_counts}: "
                f"{_counts_problem(got_counts, want_counts, expert_of, experts, ep)}"
            ]
        if got_order != want_order:
            more = "..." if m > 12 else ""
            return [
                f"{case}: order {got_order[:12]}{more}, expected {want_order[:12]}{more}: "
                f"{_order_problem(got_order, expert_of, experts, ep)}"
            ]
    return []
