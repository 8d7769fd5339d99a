"""Lesson 12's thread exhibit: processes launched without OMP_NUM_THREADS, and the threads each one starts
(mp.spawn against torchrun, which sets it to 1)."""

from __future__ import annotations

import os
import re
import sys

from common.exhibits.frame import Ctx, exhibit
from common.exhibits.launchers import TORCHRUN

__all__ = ["too_many_threads"]


def _thread_counts(out: str) -> list[tuple[int, int]]:
    """[(torch threads, DataLoader worker threads), ...] from the `threads` worker's lines."""
    found = re.findall(r"torch threads (\d+), DataLoader worker threads (\d+)", out)
    return [(int(t), int(w)) for t, w in found]


@exhibit(
    "too_many_threads",
    "training",
    lesson="03",
    symptom="",
    cause="each process starts the torch threads it would start alone (one "
    "per core); torchrun sets OMP_NUM_THREADS=1 when nproc_per_node "
    "> 1, mp.spawn does not (DataLoader workers run one thread each)",
    when=(
        "no error: more processes make training slower, top shows 100% on every core "
        "(mp.spawn, or a launcher that does not set OMP_NUM_THREADS)"
    ),
    fix=(
        "torchrun (it sets OMP_NUM_THREADS=1 for nproc_per_node > 1 and says so), or set "
        "OMP_NUM_THREADS = cores // processes before mp.spawn"
    ),
)
def too_many_threads(ctx: Ctx) -> None:
    cores = len(os.sched_getaffinity(0))
    with ctx.rank0("launches without OMP_NUM_THREADS") as mine:
        if not mine:
            return
        unset = {"OMP_NUM_THREADS": None}  # as in a fresh shell
        spawn = [sys.executable, "-m", "common.exhibits.worker", "threads_spawn", "2"]
        code, out = ctx.launch(spawn, 90, unset)
        spawned = _thread_counts(out)
        ctx.step("symptom", f"mp.spawn of 2 processes on {cores} cores, OMP_NUM_THREADS unset:")
        for line in sorted(re.findall(r"rank \d+: torch threads .*", out)):
            ctx.say(f"    {line}")
        ctx.record("symptom", spawned)
        alone = int((re.findall(r"one process alone: torch threads (\d+)", out) or ["0"])[0])
        total = sum(t for t, _ in spawned)
        ctx.claim(
            "broken_threads_vs_alone",
            total / alone if alone and len(spawned) == 2 else 0.0,
            "==",
            2.0,
            "threads of 2 processes / of one alone ({alone}): {value:g} ({total} threads on {cores} cores)",
            alone=alone,
            total=total,
            cores=cores,
        )
        ctx.step(
            "diagnosis",
            "torch.get_num_threads() in each process, times processes; a DataLoader worker "
            "sets itself to one thread",
        )
        ctx.claim(
            "dataloader_worker_threads",
            max((w for _, w in spawned), default=0),
            "==",
            1,
            "threads of a DataLoader worker: {value}",
        )
        _fixed_by_torchrun(ctx, unset)


def _fixed_by_torchrun(ctx: Ctx, unset: dict) -> None:
    """The fix, measured: the same worker under torchrun (rank 0 alone launches it)."""
    torchrun = [*TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "common.exhibits.worker"]
    code, out = ctx.launch([*torchrun, "threads"], 90, unset)
    launched = _thread_counts(out)
    ctx.step(
        "fix",
        "torchrun (it sets OMP_NUM_THREADS=1 for nproc_per_node > 1 and says so), or set "
        "OMP_NUM_THREADS = cores // processes before mp.spawn",
    )
    for line in sorted(re.findall(r"rank \d+: torch threads .*", out)):
        ctx.say(f"    {line}")
    per_process = max(t for t, _ in launched) if len(launched) == 2 else 0
    ctx.claim(
        "fixed_threads_per_process",
        per_process,
        "==",
        1,
        "torch threads per process under torchrun: {value}",
    )
