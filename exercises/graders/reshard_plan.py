"""Grader of exercises/reshard_plan.py: the pieces a loading rank reads, over many sizes, checked by reading
them: saved shards cut from a tensor with torch.chunk (FSDP2's split), pieces concatenated, compared with the
loading rank's own chunk."""

from __future__ import annotations

import importlib
import itertools

import torch

WORLD_SIZE = 0
FUNCTIONS = ["read_plan"]
CASES = list(itertools.product((33, 10, 7, 3, 1, 64), (1, 2, 3, 4, 8), (1, 2, 3, 4, 8)))


def _held(rows: int, world: int, rank: int) -> tuple[int, int]:
    c = -(-rows // world)
    return min(rank * c, rows), min((rank + 1) * c, rows)


def _problem(pieces, rows: int, saved_by: int, loaded_by: int, rank: int) -> str | None:
    case = f"rows {rows}, saved by {saved_by}, loaded by {loaded_by}, rank {rank}"
    if not isinstance(pieces, list) or any(len(p) != 3 for p in pieces):
        return f"{case}: return a list of (saved rank, first row, end row) tuples"
    if any(start >= end for _, start, end in pieces):
        return f"{case}: {pieces} has an empty piece (first row >= end row): leave it out"
    lo, hi = _held(rows, loaded_by, rank)
    whole = torch.arange(rows)
    shards = torch.chunk(whole, saved_by)  # file s holds shards[s]
    read = []
    for saved, start, end in pieces:
        s_lo, s_hi = _held(rows, saved_by, saved)
        if not (s_lo <= start and end <= s_hi):
            if 0 <= start < end <= s_hi - s_lo and (start, end) != (s_lo, s_hi):
                return (
                    f"{case}: piece {(saved, start, end)} looks counted from the start of file {saved}: "
                    f"rows are global, counted in the whole tensor (file {saved} holds {s_lo}..{s_hi - 1})"
                )
            return f"{case}: piece {(saved, start, end)}: file {saved} holds rows {s_lo}..{s_hi - 1} only"
        read.append(shards[saved][start - s_lo : end - s_lo])
    got = torch.cat(read) if read else whole[:0]
    floor = max(rows // loaded_by, 1)
    floor_rows = whole[rank * floor : rows if rank == loaded_by - 1 else (rank + 1) * floor]
    if not torch.equal(got, whole[lo:hi]) and torch.equal(got, floor_rows):
        return (
            f"{case}: your pieces read rows {rank * floor}..{rank * floor + len(got) - 1}, the rank "
            f"holds rows {lo}..{hi - 1}: c = ceil(rows / W) rows per rank (torch.chunk), not rows // W"
        )
    if not torch.equal(got, whole[lo:hi]):
        return (
            f"{case}: your pieces read rows {got.tolist()}, the rank holds rows {lo}..{hi - 1}: every row "
            f"once, in order"
        )
    return None


def check(module: str) -> list[str]:
    mod = importlib.import_module(module)
    for rows, saved_by, loaded_by in CASES:
        for rank in range(loaded_by):
            problem = _problem(
                mod.read_plan(rows, saved_by, loaded_by, rank), rows, saved_by, loaded_by, rank
            )
            if problem:
                return [problem]
    return []
