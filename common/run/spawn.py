"""Starting a world with `torch.multiprocessing.spawn` from a notebook, bounded, and why the function must be
importable (lesson 03).

`mp.spawn(fn, args=(...), nprocs=N)` starts N fresh interpreters (start method "spawn") and calls
`fn(rank, *args)` in each; it sets no environment variable. The parent sets MASTER_ADDR and MASTER_PORT (the
children inherit them) and each child passes its rank and the world size to `init_process_group`:
`common/harness/spawn.py` (lesson 03's `--spawn N`) is the code to copy. This module holds what notebook 03 and the
tests need to show it from inside a notebook: a bounded spawn that keeps the children's output out of the cells.

Why importable: `fn` travels to the children pickled by reference, as (module name, function name); each
child imports the module and looks the name up. A function defined in a notebook cell (or in `python -c`)
lives in the parent's `__main__`, which has no file a child could import, so every child dies with
"AttributeError: Can't get attribute 'fn' on <module '__main__' ...>" and mp.spawn raises
`ProcessExitedException`. A function imported from a module (here: `common.harness.spawn.spawn_worker`) works.
See https://pytorch.org/docs/stable/multiprocessing.html#spawning-subprocesses and the "programming
guidelines" of Python's multiprocessing (https://docs.python.org/3/library/multiprocessing.html).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from common.harness.spawn import free_port

__all__ = ["SpawnOutcome", "spawn_and_wait"]


@dataclass
class SpawnOutcome:
    """What a bounded spawn left behind.

    Attributes:
        ok: every child exited with status 0.
        error: the exception mp raised ("" when ok), e.g. "ProcessExitedException: ... exit code 1".
        output: the children's stdout and stderr together (tracebacks included).
    """

    ok: bool
    error: str = ""
    output: str = ""

    def matches(self, pattern: str) -> list[str]:
        """The distinct matches of the regular expression `pattern` in `output`, sorted. The children
        write to one file, so two tracebacks can interleave part by part ("AttributeErrorAttributeError:
        : ..."); one message is one write, so it survives whole."""
        return sorted(set(re.findall(pattern, self.output)))


def spawn_and_wait(
    fn: Callable, args: tuple = (), nprocs: int = 2, timeout_s: float = 60.0
) -> SpawnOutcome:
    """`mp.spawn(fn, args=args, nprocs=nprocs)` with MASTER_ADDR/PORT set for it, bounded by `timeout_s`.

    The children's stdout and stderr go to a file (returned as `output`), not to the caller's: in a notebook
    they would otherwise land in whichever cell runs when they arrive. The caller's environment is restored.

    Raises:
        TimeoutError: the children did not finish within `timeout_s` (they are killed first).
    """
    with tempfile.TemporaryFile("w+") as log:
        sys.stdout.flush()
        sys.stderr.flush()
        saved_fds, saved_env = [os.dup(1), os.dup(2)], dict(os.environ)
        # the parent's job: say where rank 0's store listens (the children inherit the environment); and one
        # thread per child unless told otherwise, as common.run.launch does (N processes on few cores)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        )
        try:  # the children inherit file descriptors 1 and 2 as they are while they start
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
        finally:
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            os.environ.clear()
            os.environ.update(saved_env)
        deadline, error = time.monotonic() + timeout_s, ""
        quiet = logging.getLogger(
            "torch.multiprocessing.spawn"
        )  # "Terminating process <pid>": run-dependent
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise TimeoutError(f"spawned world of {nprocs} did not finish in {timeout_s} s")
        except ProcessException as e:  # a child failed: mp terminates the others and raises
            error = f"{type(e).__name__}: exit code {getattr(e, 'exit_code', '?')}"
        finally:
            quiet.setLevel(level)
        for p in ctx.processes:
            p.join(timeout=10)
        log.seek(0)
        return SpawnOutcome(ok=not error, error=error, output=log.read())
