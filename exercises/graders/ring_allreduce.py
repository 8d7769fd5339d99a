"""Grader of exercises/ring_allreduce.py: 4 ranks, tensors of several lengths; the reduce-scatter against
each rank's chunk of the exact sum, the all-reduce against the exact sum; no collective allowed, and the bytes
each rank sends counted."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from exercises.graders._common import (
    close,
    collectives_forbidden,
    functions_replaced,
    rank_failures,
    short,
)

WORLD_SIZE = 4
FUNCTIONS = ["ring_reduce_scatter", "ring_all_reduce"]
LENGTHS = (
    10,
    3,
    1001,
)  # 10: chunks of 3, 3, 2, 2; 3: shorter than the ring (one chunk is empty); 1001: long


def rank_tensor(rank: int, length: int) -> torch.Tensor:
    """What rank `rank` starts with: different on every rank, so that a missing contribution shows."""
    return (torch.arange(length, dtype=torch.float64) + 1) * (rank + 1) + 0.25 * rank


def expected(length: int, world_size: int) -> torch.Tensor:
    """The sum over ranks, computed without any collective (so a grader never waits on a learner's bug)."""
    return sum(rank_tensor(r, length) for r in range(world_size))


def counting_sends(sent: list[int]):
    """isend and send (also as the op of a P2POp) that add the bytes they send to sent[0]."""

    def wrap(original):
        def call(tensor, *args, **kwargs):
            sent[0] += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)

        call.__name__ = original.__name__  # P2POp's repr reads it
        return call

    return {c10d.isend: wrap(c10d.isend), c10d.send: wrap(c10d.send)}


def on_rank(module: str) -> dict[str, list]:
    learner = importlib.import_module(module)
    out: dict[str, list] = {"reduce_scatter": [], "all_reduce": []}
    for length in LENGTHS:
        for what, fn in (
            ("reduce_scatter", learner.ring_reduce_scatter),
            ("all_reduce", learner.ring_all_reduce),
        ):
            x = rank_tensor(dist.get_rank(), length)
            sent = [0]
            with (
                collectives_forbidden("build it from isend/irecv only", [learner]),
                functions_replaced(counting_sends(sent), [learner]),
            ):
                result = fn(x)
            got = x if what == "all_reduce" else torch.as_tensor(result)
            out[what].append((got.tolist(), sent[0]))
    return out


def minimal_schedule(length: int, world_size: int) -> list[list[torch.Tensor]]:
    """The chunks each rank holds after lesson 02's minimal reduce-scatter (rank r sends chunk (r - s) mod n
    at step s), simulated: rank r ends with the full sum of chunk (r + 1) mod n and a partial chunk r."""
    n = world_size
    held = [list(torch.tensor_split(rank_tensor(r, length).clone(), n)) for r in range(n)]
    for step in range(n - 1):
        sent = [held[r][(r - step) % n].clone() for r in range(n)]
        for r in range(n):
            held[r][(r - step - 1) % n] += sent[(r - 1) % n]
    return held


def most_bytes(length: int, world_size: int) -> int:
    """What one rank of a ring all-reduce sends at most: 2 (n - 1) chunks of at most ceil(L / n) elements,
    about 2 (n - 1) / n x the tensor."""
    return 2 * (world_size - 1) * -(-length // world_size) * 8


def _reduce_scatter_problems(answers: list) -> list[str]:
    n = len(answers)
    for i, length in enumerate(LENGTHS):
        chunks = torch.tensor_split(expected(length, n), n)
        for rank, (got, sent) in enumerate(a["reduce_scatter"][i] for a in answers):
            want = chunks[rank]
            case = f"ring_reduce_scatter, length {length}: rank {rank}"
            if close(got, want, 1e-9):
                if sent > most_bytes(length, n) // 2:
                    return [
                        f"{case} sent {sent} bytes for a tensor of {length * 8}; a ring reduce-scatter "
                        f"sends (n-1)/n x the tensor, at most {most_bytes(length, n) // 2} here: send "
                        f"one chunk of torch.tensor_split(tensor, n) per step, not the whole tensor"
                    ]
                continue
            if len(got) != len(want):
                return [
                    f"{case} returned {len(got)} elements; its chunk, torch.tensor_split(tensor, {n})"
                    f"[{rank}], has {len(want)}: return only the sum of chunk r"
                ]
            minimal = minimal_schedule(length, n)[rank]
            schedule = (
                minimal[rank],
                minimal[(rank + 1) % n],
            )  # its chunk r, and the chunk it completed
            if any(len(got) == len(c) and close(got, c, 1e-9) for c in schedule):
                return [
                    f"{case} holds {short(got)}, expected {short(want.tolist())}: that is the minimal "
                    f"script's schedule (send chunk (r - s) mod n at step s), which completes chunk "
                    f"(r + 1) mod n on rank r; shift it by one so that the chunk rank r completes is r"
                ]
            return [
                f"{case} holds {short(got)}, expected {short(want.tolist())}: did every rank send to "
                f"rank + 1 and receive from rank - 1, adding what it receives into its own chunk, for "
                f"n - 1 steps?"
            ]
    return []


def judge(answers: list) -> list[str]:
    problems = rank_failures(answers)
    if any("size" in p for p in problems):
        problems.append(
            "a rank received a chunk of another size than it posted for: at each step, rank r "
            "must send to rank + 1 the chunk that rank + 1 receives from rank - 1"
        )
    if problems:
        return problems
    problems = _reduce_scatter_problems(answers)
    if problems:
        return problems
    n = len(answers)
    for i, length in enumerate(LENGTHS):
        want = expected(length, n)
        for rank, (got, sent) in enumerate(a["all_reduce"][i] for a in answers):
            if close(got, want, 1e-9):
                if sent > most_bytes(length, n):
                    problems.append(
                        f"ring_all_reduce, length {length}: rank {rank} sent {sent} bytes for a "
                        f"tensor of {length * 8}; a ring all-reduce sends 2(n-1)/n x the tensor, "
                        f"at most {most_bytes(length, n)} here: send one chunk of "
                        f"torch.tensor_split(tensor, n) per step, not the whole tensor"
                    )
                    break
                continue
            start = rank_tensor(rank, length)
            if close(got, start, 0.0):
                hint = "its tensor is unchanged: write what you receive into the chunk views of `tensor`"
            else:
                hint = (
                    "after your reduce-scatter rank r holds the finished chunk r: the all-gather sends "
                    "it on first, then each chunk it receives, n - 1 steps, copying (not adding)"
                )
            problems.append(
                f"ring_all_reduce, length {length}: rank {rank} holds {short(got)}, expected "
                f"{short(want)}: {hint}"
            )
            break
    return problems
