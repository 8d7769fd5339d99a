"""The frame of lesson 12's exhibits: a registry, and a context that runs a broken version bounded.

An exhibit is a small function, one per failure, that shows three things in order:

    symptom    the broken version, run the way a user runs it, and what the user sees (the error text or the
               wrong number), bounded by --timeout-s: a collective nobody joins raises instead of hanging
    diagnosis  the step that reveals the cause (TORCH_DISTRIBUTED_DEBUG=DETAIL, monitored_barrier, a count)
    fix        the right version and its result

Exhibits live in the modules `common.exhibits.<name>` for each name in MODULES, and register themselves
with `@exhibit(...)`. Two ways to keep one exhibit's failure from poisoning the next:
- in-world exhibits run every broken collective in a fresh gloo group (`ctx.group()`) with the short timeout;
  the default group (a long timeout) only gathers the outcomes to rank 0;
- a failure that kills the process (gloo aborts on a size mismatch), a launcher mistake or a second job runs
  as a bounded subprocess on rank 0 (`ctx.launch`, `common.run.processes.run_command` with a timeout).
"""

from __future__ import annotations

import importlib
import re
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from common.harness.env import DistInfo
from common.harness.ranks import gather_to_rank0
from common.harness.results import Report
from common.harness.session import gloo_group, rank0_only
from common.run.processes import LessonTimeout, run_command

__all__ = [
    "Exhibit",
    "EXHIBITS",
    "GROUPS",
    "exhibit",
    "load_exhibits",
    "Outcome",
    "Ctx",
    "normalise",
    "first_line",
]

GROUPS = ("collectives", "training", "launch")
# common.exhibits.<module>, in --list order
MODULES = (
    "collectives",
    "unused_parameters",
    "uneven",
    "training",
    "batchnorm",
    "threads",
    "loading",
    "gradients",
    "nan",
    "launchers",
    "jobs",
)


@dataclass(frozen=True)
class Exhibit:
    """One reproduced failure.

    Attributes:
        name: snake_case, used by `--show NAME` and in the README's symptom index.
        group: "collectives" (2 ranks, bounded hangs), "training" (wrong numbers and errors) or "launch"
            (launchers as subprocesses on rank 0).
        symptom: the exact error text, as a search for it types it ("" when nothing raises: a wrong number).
        cause: one line.
        lesson: the lesson that teaches the right way ("03").
        fn: `fn(ctx)`, run on every rank.
        min_world: ranks the exhibit needs (it is skipped with a note on fewer).
        when: where and how it shows (which rank, which call; the behaviour when nothing raises).
        fix: the fix in one line, a part of the text of the exhibit's own `fix:` step (a test holds it so).
    """

    name: str
    group: str
    symptom: str
    cause: str
    lesson: str
    fn: Callable
    min_world: int = 1
    when: str = ""
    fix: str = ""


EXHIBITS: dict[str, Exhibit] = {}


def exhibit(
    name: str,
    group: str,
    symptom: str,
    cause: str,
    lesson: str,
    fix: str,
    when: str = "",
    min_world: int = 1,
):
    """Decorator: register `fn(ctx)` as the exhibit `name`."""

    def register(fn: Callable) -> Callable:
        if name in EXHIBITS:
            raise ValueError(f"exhibit {name!r} registered twice")
        if not symptom and not when:
            raise ValueError(f"exhibit {name!r}: give the error text, or say when it shows")
        EXHIBITS[name] = Exhibit(name, group, symptom, cause, lesson, fn, min_world, when, fix)
        return fn

    return register


def load_exhibits() -> dict[str, Exhibit]:
    """Import the exhibit modules (each registers its exhibits) and return the registry, in group order."""
    for module in MODULES:
        importlib.import_module(f"common.exhibits.{module}")
    return dict(sorted(EXHIBITS.items(), key=lambda kv: GROUPS.index(kv[1].group)))


WIDTH = 120  # the longest line a lesson prints

_NOISE = [  # run-dependent parts of error texts -> fixed tokens, so that printed lines compare equal (nbval)
    (re.compile(r"\[/\S*?/third_party/(gloo/\S+?):\d+\]"), r"[\1]"),
    (re.compile(r"\[enforce fail at /\S*?/third_party/(gloo/\S+?):\d+\]"), r"[enforce fail at \1]"),
    (re.compile(r"(127\.0\.0\.1|localhost)\]?:\d+"), r"\1:PORT"),
    (re.compile(r"port: \d+"), "port: PORT"),
    (re.compile(r"pid[: ]+\d+", re.I), "pid PID"),
    (re.compile(r"\x1b\[[0-9;]*m"), ""),  # terminal colours in torch.load's message
]


def normalise(text: str, ports: Sequence[int] = ()) -> str:
    """Replace ports, PIDs and build paths in an error text by fixed tokens (what varies between runs)."""
    for pattern, repl in _NOISE:
        text = pattern.sub(repl, text)
    for p in ports:
        text = text.replace(str(p), "PORT")
    return text


def first_line(text: str, containing: str = "", limit: int = 160) -> str:
    """The first line of `text` that contains `containing` (normalised, cut at `limit` characters), or ''."""
    for line in text.splitlines():
        if containing in line and line.strip():
            line = normalise(line.strip())
            return line if len(line) <= limit else line[: limit - 3] + "..."
    return ""


@dataclass
class Outcome:
    """What one rank's attempt ended with: a value, or an exception's class and first line."""

    value: object = None
    error: str | None = None
    full: str = ""  # the whole error message, normalised

    @property
    def failed(self) -> bool:
        return self.error is not None

    def line(self) -> str:
        return f"{self.error}" if self.failed else f"finished: {self.value}"


class Ctx:
    """What an exhibit works with: who this rank is, fresh bounded groups, outcomes, and the report.

    Every method may be called on every rank; printing happens on rank 0 (through `Report`), and each
    exhibit's claims are named `<exhibit>_<what>` in the results JSON.
    """

    def __init__(self, ex: Exhibit, info: DistInfo, report: Report, timeout_s: float):
        self.ex, self.info, self.report, self.timeout_s = ex, info, report, timeout_s
        try:
            shown = report.recorded("exhibits")
        except KeyError:  # the first exhibit of the run
            shown = report.record("exhibits", {})
        self.results = shown.setdefault(ex.name, {})

    # -- groups and attempts -----------------------------------------------------------------------------
    def group(self, detail: bool = False, timeout_s: float | None = None):
        """A fresh gloo group of every rank, bounded by --timeout-s (every rank calls this, in one order).

        detail=True wraps it as TORCH_DISTRIBUTED_DEBUG=DETAIL would: before each collective the ranks compare
        its fingerprint (op, shapes, dtypes) and raise "Detected mismatch between collectives on ranks".
        """
        timeout_s = timeout_s or self.timeout_s
        if (
            not detail
        ):  # created under a long timeout, then shortened (the DETAIL wrapper cannot be)
            return gloo_group(timeout_s)
        dist.set_debug_level(dist.DebugLevel.DETAIL)
        try:
            return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        finally:
            dist.set_debug_level(dist.DebugLevel.OFF)

    def attempt(self, fn: Callable, *args, **kwargs) -> Outcome:
        """Run `fn(*args, **kwargs)` on this rank; an exception becomes `Outcome.error` ("Class: line")."""
        try:
            return Outcome(value=fn(*args, **kwargs))
        except Exception as e:  # the symptom is the exception: keep its class and first line
            return Outcome(
                error=f"{type(e).__name__}: {first_line(str(e)) or type(e).__name__}",
                full=normalise(str(e)),
            )

    def gather(self, obj) -> list:
        """`obj` from every rank, in rank order, on rank 0 (through the default group); [] elsewhere."""
        return gather_to_rank0(obj, self.info) or []

    def outcomes(
        self,
        outcome: Outcome,
        key: str,
        label: str,
        ranks: Sequence[int] | None = None,
        example: str | None = None,
    ) -> list[str]:
        """Print `label` and each rank's outcome line (`ranks`: those to print); record them under `key`.

        example="Timed out": when both ranks time out, which one's peer closes the pair first is a race; print
        the failing ranks and one line that contains `example` instead of each rank's line.
        """
        lines = [o.line() for o in self.gather(outcome)]
        self.results[key] = lines
        self.say(label)
        if example is not None and lines:
            failed = [r for r, line in enumerate(lines) if not line.startswith("finished")]
            sample = next((line for line in lines if example in line), "")
            self.say(f"    ranks {failed} raise, e.g. {sample}")
            return lines
        for r, line in enumerate(lines):
            if ranks is None or r in ranks:
                self.say(f"    [rank {r}] {line}")
        return lines

    @contextmanager
    def rank0(self, phase: str) -> Iterator[bool]:
        """Rank-0-only work (a subprocess launch) while the others wait without the short timeout."""
        with rank0_only(self.info, f"exhibit {self.ex.name}: {phase}") as mine:
            yield mine

    def launch(self, cmd: Sequence[str], timeout_s: float = 60, env: dict | None = None):
        """Run `cmd` as a bounded subprocess (rank 0 only); returns (returncode or 'timeout', output)."""
        try:
            p = run_command(cmd, timeout_s=timeout_s, env=env)
            return p.returncode, p.stdout + p.stderr
        except LessonTimeout as e:
            return "timeout", e.output

    # -- reporting -------------------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        """Print on rank 0; a line longer than WIDTH (a quoted error text) goes on over indented lines."""
        for line in text.split("\n"):
            if len(line) <= WIDTH:
                self.report._say(line)
                continue
            indent = " " * (len(line) - len(line.lstrip()) + 2)
            for part in textwrap.wrap(
                line, WIDTH, subsequent_indent=indent, break_on_hyphens=False
            ):
                self.report._say(part)

    def step(self, kind: str, text: str) -> None:
        """A section line: kind is "symptom", "diagnosis" or "fix"."""
        self.say(f"  {kind}: {text}")

    def claim(self, what: str, value, relation: str, bound: float, text: str, **fields) -> bool:
        name = f"{self.ex.name}_{what}"
        return self.report.claim(name, value, relation, bound, "    " + text, **fields)

    def record(self, key: str, value):
        self.results[key] = value
        return value


def run_exhibit(ex: Exhibit, info: DistInfo, report: Report, timeout_s: float) -> None:
    """Run one exhibit on every rank: a header, its symptom, diagnosis and fix (printed on rank 0)."""
    ctx = Ctx(ex, info, report, timeout_s)
    ctx.say(f"== {ex.name} (lesson {ex.lesson}) ==")
    if info.world_size < ex.min_world:
        ctx.say(f"  skipped: needs {ex.min_world} ranks (torchrun --nproc_per_node={ex.min_world})")
        ctx.record("skipped", True)
        return
    ex.fn(ctx)
    sys.stdout.flush()
