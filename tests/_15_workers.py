"""Lesson 15 with a NaN planted in what rank 1 loads: every equality claim about a load must then fail.

    torchrun --standalone --nproc_per_node=2 tests/_15_workers.py --load ROOT [the lesson's arguments]

The lesson's own `main` runs unchanged (through `run_main`, so the exit status is the lesson's); only its
`load_sharded` is wrapped: after the real load, rank 1 writes NaN into the first element of the model's first
parameter (its local shard under FSDP2). A NaN-safe comparison over ranks makes `sharded_load_equals_saved`
and `params_equal_at_the_switch` fail and the lesson exit 1; a check that dropped rank 1's NaN would pass.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from common.checkpoint.sharded import load_sharded
from common.harness.session import run_main

RUNNER = Path(__file__)
lesson = importlib.import_module("lessons.15_checkpoints")
REAL = load_sharded


def load_with_nan_on_rank1(model, optimizer, path, group=None) -> None:
    REAL(model, optimizer, path, group)
    if dist.get_rank() == 1:
        p = next(model.parameters())
        local = p._local_tensor if hasattr(p, "_local_tensor") else p
        with torch.no_grad():
            local.view(-1)[0] = float("nan")


def launch_with_nan_on_rank1(args, timeout_s: float = 240):
    from common.run.launch import run_lesson

    return run_lesson(RUNNER, nproc=2, args=list(args), timeout_s=timeout_s)


if __name__ == "__main__":
    lesson.load_sharded = load_with_nan_on_rank1  # the name the lesson calls
    sys.argv = [str(lesson.__file__), *sys.argv[1:]]
    run_main(lesson.main)
