"""Injected faults, and the events log every rank writes while it survives them (lesson 16).

A fault is `KIND@STEP[:RANK]`; the i-th fault of a list fires in torchrun's attempt i only
(`common.harness.rendezvous.attempt()` = i, agreed by every node), so the restarted job does not fail again there:

    exit@7:1           rank 1 calls os._exit(1) during step 7 (after its forward): no cleanup, no exception
    raise@7:1          rank 1 raises InjectedFault in step 7: `@record` on main writes its error file
    hang@7:1           rank 1 sleeps forever during step 7: its peers wait in the all-reduce until --timeout-s
    mid-write@8        the writer (global rank 0) dies after writing half of step 8's checkpoint
    before-rename@8    the writer dies after writing all of it, before the temp file is renamed

Every rank appends what happens to `events.jsonl` beside the checkpoints (one JSON line per event, with
time.time(): comparable across processes of one machine; across nodes the clocks may differ by their skew).
`common.fault_tolerance.timeline` turns those lines into what a reader asks after a crash: which steps were
trained twice, how long the restart took, how much work was lost.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from common.harness.env import LessonError
from common.harness.process_exit import exit_process

__all__ = [
    "KINDS",
    "InjectedFault",
    "Fault",
    "read_error_file",
    "parse_faults",
    "EventLog",
    "exit_on_peer_failure",
]

KINDS = ("exit", "raise", "hang", "mid-write", "before-rename")


class InjectedFault(Exception):
    """Raised by a `raise@STEP:RANK` fault; not a RuntimeError, so `exit_on_peer_failure` lets it through."""


def read_error_file(path: str | None) -> str | None:
    """The message `@record` (torch.distributed.elastic.multiprocessing.errors) wrote for a rank that raised."""
    try:
        return json.loads(Path(path).read_text())["message"]["message"]
    except (OSError, TypeError, ValueError, KeyError):
        return None


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int

    def strike(self, step: int, rank: int, log: EventLog) -> None:
        """In step `step` on `rank`: exit (os._exit, no cleanup, no exception) or sleep forever, as scheduled."""
        if self.kind in ("exit", "raise", "hang") and (self.step, self.rank) == (step, rank):
            # torchrun gives each worker the file `@record` writes an uncaught exception to
            log.write(
                "fault",
                fault=self.kind,
                step=step,
                error_file=os.environ.get("TORCHELASTIC_ERROR_FILE"),
            )
            if self.kind == "exit":
                os._exit(1)
            if self.kind == "raise":
                raise InjectedFault(f"injected fault in step {step} on rank {rank}")
            while True:
                time.sleep(3600)

    def writer_hook(self, step: int, log: EventLog):
        """The `fault(point, file, payload)` hook for `save_train_state` at `step`: the writer dies at `point`;
        None when this fault does not hit this save."""
        if self.kind not in ("mid-write", "before-rename") or step != self.step:
            return None

        def hook(point, f, payload) -> None:
            if point == self.kind:
                f.flush()  # what was written reaches the file, as a killed process's writes do
                log.write("fault", fault=self.kind, step=step)
                os._exit(1)

        return hook


def parse_faults(
    specs: list[str], steps: int, world_size: int, is_save_step, max_restarts: int
) -> list[Fault]:
    """Parse `KIND@STEP[:RANK]` strings; LessonError for anything that cannot happen in this run."""
    faults = []
    for spec in specs:
        try:
            kind, rest = spec.split("@")
            step, rank = (int(v) for v in rest.split(":")) if ":" in rest else (int(rest), 0)
        except ValueError:
            raise LessonError(f"fault {spec!r}: expected KIND@STEP[:RANK], e.g. exit@7:1") from None
        if kind not in KINDS:
            raise LessonError(f"fault {spec!r}: KIND must be one of {', '.join(KINDS)}")
        if not 1 <= step <= steps:
            raise LessonError(
                f"fault {spec!r}: step {step} is beyond the run (steps 1..{steps}, --steps {steps})"
            )
        if not 0 <= rank < world_size:
            raise LessonError(
                f"fault {spec!r}: rank {rank} does not exist in a world of {world_size}"
            )
        if kind in ("mid-write", "before-rename") and (rank != 0 or not is_save_step(step)):
            raise LessonError(
                f"fault {spec!r}: only global rank 0 writes, at checkpoint steps (--ckpt-every)"
            )
        faults.append(Fault(kind, step, rank))
    if faults and max_restarts < len(faults):
        raise LessonError(
            f"{len(faults)} fault(s) need torchrun --max-restarts >= {len(faults)} (got "
            f"{max_restarts}; plain python cannot restart): without it the job just fails"
        )
    return faults


class EventLog:
    """Appends `{"t", "attempt", "rank", "kind", ...}` lines to one file; each line is one write(2) with
    O_APPEND, so lines from several ranks never interleave inside a line."""

    def __init__(self, path: str | Path, attempt: int, rank: int):
        self.path, self.attempt, self.rank = Path(path), attempt, rank
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, kind: str, **fields) -> None:
        line = json.dumps(
            {"t": time.time(), "attempt": self.attempt, "rank": self.rank, "kind": kind, **fields}
        )
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


@contextmanager
def exit_on_peer_failure(log: EventLog):
    """Around the training loop: a collective that raises (gloo: a peer's socket closed, or no answer within
    --timeout-s) -> one line, an event, and exit status 1, so that torchrun restarts every rank."""
    try:
        yield
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        log.write("peer-failure", error=first[:300])
        os.write(
            2,
            f"[rank {log.rank}] a collective failed: {first[:160]}; exiting 1 so that torchrun restarts "
            "the job\n".encode(),
        )
        exit_process(1)
