"""Run a grader's per-rank function on a few gloo processes and bring each rank's answer back.

    answers = run_on_ranks("exercises._grading:_on_rank", 4, 1, grader="ring_allreduce",
                           modules=["exercises.ring_allreduce"])

Each rank is a new process forked from a server process that imported torch once (multiprocessing's
`forkserver`; `spawn`, as `mp.spawn` starts them, where there is no forkserver): it imports the exercise
afresh, so an edited answer is graded as it now is, and it starts in about 0.1 s instead of the 1-2 s an
import of torch takes. The ranks join one process group through a file in a temporary folder, with every
collective under `COLLECTIVE_TIMEOUT_S`. The rank function is named by its import path, so the child imports
it (a function defined in a notebook cell could not be sent to a child).
What a rank function returns (any picklable value) comes back in rank order; an exception comes back as its
one-line text, and a rank that never answers (a learner's send with no matching receive) comes back as
`RankHung`, so a grader can say which rank waited and why.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

__all__ = ["COLLECTIVE_TIMEOUT_S", "RankError", "RankHung", "describe", "run_on_ranks", "resolve"]

# A correct answer finishes in well under a second; a wrong one may wait for a message nobody sends. The
# timeout is a safety net for that case (generous, so that a busy machine never fails a correct answer).
COLLECTIVE_TIMEOUT_S = 60.0


@dataclass
class RankError:
    """The rank raised: `text` is the exception's last line, `where` the learner's line that raised it."""

    text: str
    where: str = ""
    collectives: int | None = (
        None  # how many collectives the rank had called when it raised (if counted)
    )

    def __str__(self) -> str:
        return f"{self.text}{f' (at {self.where})' if self.where else ''}"


@dataclass
class RankHung:
    """The rank gave no answer within the launch's time limit."""

    seconds: float

    def __str__(self) -> str:
        return f"no answer after {self.seconds:.0f} s (waiting for a message no rank sent?)"


def resolve(path: str):
    """'package.module:function' -> the function."""
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _where(exc: BaseException) -> str:
    """The last frame of the traceback that lies in the learner's (or a reference) exercise file."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if "/exercises/" in f.filename
        and "/exercises/graders/" not in f.filename
        and not Path(f.filename).name.startswith("_")
    ]
    if not frames:
        return ""
    f = frames[-1]
    return f"{Path(f.filename).name}:{f.lineno}: {f.line}"


def describe(e: BaseException) -> RankError:
    """An exception raised by a learner's code, as one line and the learner's line that raised it."""
    if isinstance(e, NotImplementedError):
        return RankError(
            f"NotImplementedError: {e}" if str(e) else "NotImplementedError (not solved yet)",
            _where(e),
        )
    last = traceback.format_exception_only(type(e), e)[-1].strip().splitlines()[0]
    return RankError(last[:300], _where(e))


def _child(rank: int, world_size: int, tmp: str, fn_path: str, kwargs: dict, answers) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # What this rank prints to stderr goes to a file: when gloo aborts the process (a message whose size does
    # not match the receive, for example), its last line is the only explanation, and the grader quotes it.
    err = os.open(str(Path(tmp) / f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    index = 0
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        # Each answer leaves as soon as it exists, through this rank's own pipe: send() has written it when
        # it returns, so an answer survives a later abort of the process (a queue's feeder thread may not).
        for index, answer in enumerate(resolve(fn_path)(**kwargs)):
            answers.send((index, answer))
    except (
        Exception
    ) as e:  # the learner's code may raise anything: report it, do not crash the grader
        answers.send((index, describe(e)))
    answers.send((None, None))  # this rank is done
    try:
        # Leave without waiting on the other ranks: a rank that waits in destroy_process_group for a peer
        # that is stuck would turn one learner's mistake into a hang of the grader.
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def _last_words(tmp: str, rank: int) -> str:
    """The last informative line a dead rank wrote to stderr (gloo's abort message, usually)."""
    try:
        lines = (Path(tmp) / f"rank{rank}.err").read_text(errors="replace").splitlines()
    except OSError:
        return ""
    lines = [
        line.strip()
        for line in lines
        if line.strip() and not line.startswith(("Traceback", "  File"))
    ]
    return lines[-1][:300] if lines else ""


def _context():
    """forkserver with torch preloaded (Linux, macOS), else spawn. Only torch is preloaded: never the
    learner's module, which each rank imports as it is when the grader runs."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "torch.distributed"]
    )  # read when the server starts (the first run)
    return ctx


def run_on_ranks(
    fn_path: str, world_size: int, count: int, limit_s: float = 3 * COLLECTIVE_TIMEOUT_S, **kwargs
) -> list[list]:
    """Run the generator `fn_path(**kwargs)` on `world_size` gloo ranks; it yields `count` answers per rank.

    Returns answers[rank][i]: what the rank yielded, a `RankError` (it raised, or died: then with the last
    line it wrote to stderr), or a `RankHung` when it gave no answer within `limit_s` seconds (every rank
    still running is then killed).
    """
    ctx = _context()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]  # (reader, writer) per rank
    got: list[dict[int, object]] = [{} for _ in range(world_size)]
    with tempfile.TemporaryDirectory(prefix="exercise-") as tmp:
        procs = [
            ctx.Process(
                target=_child, args=(r, world_size, tmp, fn_path, kwargs, writer), daemon=True
            )
            for r, (_, writer) in enumerate(pipes)
        ]
        for p in procs:
            p.start()
        for _, writer in pipes:
            writer.close()  # the child holds its own copy: its death closes the pipe
        open_ = {reader: rank for rank, (reader, _) in enumerate(pipes)}
        done: set[int] = set()
        deadline = time.monotonic() + limit_s
        while open_ and len(done) < world_size and time.monotonic() < deadline:
            for reader in wait(list(open_), timeout=0.5):
                rank = open_[reader]
                try:
                    index, answer = reader.recv()
                except (EOFError, OSError):
                    del open_[reader]  # the rank ended (or died) and everything it sent was read
                    continue
                if index is None:
                    done.add(rank)
                else:
                    got[rank].setdefault(index, answer)
        timed_out = len(done) < world_size and time.monotonic() >= deadline
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        last = [_last_words(tmp, r) for r in range(world_size)]
        for reader, _ in pipes:
            reader.close()
    out = []
    for rank in range(world_size):
        died = RankError(f"the process died{': ' + last[rank] if last[rank] else ''}")
        missing = RankHung(limit_s) if timed_out and rank not in done else died
        out.append([got[rank].get(i, missing) for i in range(count)])
    return out
