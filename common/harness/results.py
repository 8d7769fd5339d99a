"""What a lesson reports, said once: printed on rank 0 and recorded under the same name in its --results JSON.

    report = Report(info)
    report.value("final_test_accuracy", acc, "final test_acc {value:.4f}")     # a number the lesson prints
    report.claim("ddp_equals_one_process", diff, "<=", 1e-5,
                 "DDP vs one process on the global batch: max |parameter difference| = {value:.1e}")
    report.perf("samples_per_s", rate, "{value:.0f} samples/s")               # timing: a [perf] line
    report.finish(args.results)       # the last line: write the JSON, say how many checks hold, set the exit status

A claim is a sentence the lesson states together with the number that proves it and the bound it is held to.
It is recorded as `results["claims"][name] = {"value", "bound", "relation", "holds", "text"}`; tests assert
the claims they expect by name and that every recorded claim holds (`tests/_lessons.assert_claims`). A claim
that does not hold is printed and recorded as such, never hidden: the lesson still finishes, then `finish` names
it on the last line ("1 of 12 checks do not hold: ddp_equals_one_process") and every rank exits with status 1.

Output discipline: the line of a claim or a value is deterministic (nbval compares it); numbers that vary from
run to run (times, throughput, memory of a process) go through `perf`, whose lines start with `[perf]` and
are left out of a notebook's compared output (`common.run.launch.LessonRun.show`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.harness.atomic import atomic_write
from common.harness.env import DistInfo
from common.harness.process_exit import set_exit_status

__all__ = ["RELATIONS", "Report", "holds"]

RELATIONS = ("<=", ">=", "==")

PERF_PREFIX = "[perf]"  # a run-dependent line (times, memory): a notebook leaves it out of its compared output


def holds(value: float, relation: str, bound: float) -> bool:
    """`value relation bound` for "<=", ">=" or "=="; False for NaN (a NaN proves nothing).

    Raises:
        ValueError: an unknown relation.
    """
    if relation not in RELATIONS:
        raise ValueError(f"relation must be one of {RELATIONS}, got {relation!r}")
    if isinstance(value, float) and math.isnan(value):
        return False
    return {"<=": value <= bound, ">=": value >= bound, "==": value == bound}[relation]


def _bound_text(bound: float) -> str:
    """A bound as a reader reads it: a byte count whole (2182180, not 2.18218e+06), other numbers short."""
    if isinstance(bound, bool):
        return str(bound)
    if float(bound).is_integer() and abs(bound) < 1e15:
        return str(int(bound))
    return f"{bound:g}"


def _plain(value: Any) -> Any:
    """A tensor or numpy scalar -> a Python number, so that the JSON holds plain numbers."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return value.item()
    return value


class Report:
    """Prints on global rank 0 and records every reported number in one dict, `results`.

    Every rank may call every method (only rank 0 prints and writes), so a lesson needs no `if master_process`
    around its reporting. Values that are the same on every rank (after an all-reduce) can be reported from
    all ranks; values only rank 0 holds (after a gather) are reported from rank 0 alone.
    """

    def __init__(self, info: DistInfo | None = None):
        self.info = info
        self.master = info is None or info.master_process
        self.results: dict[str, Any] = {"claims": {}}

    def _say(self, line: str) -> None:
        if self.master:
            print(line, flush=True)

    def record(self, name: str, value: Any) -> Any:
        """Record `value` (any JSON-able structure: a history, a table) without printing; returns it."""
        self.results[name] = _plain(value)
        return value

    def value(self, name: str, value: Any, text: str, **fields: Any) -> Any:
        """Print `text.format(value=value, **fields)` and record `value` under `name`; returns `value`.

        `text` is a plain string (not an f-string): "{value:.3f} s per step at {ranks} ranks", ranks=4."""
        self._say(text.format(value=value, **fields))
        return self.record(name, value)

    def perf(self, name: str, value: Any, text: str, **fields: Any) -> Any:
        """Like `value`, for a run-dependent number: printed as a `[perf]` line that notebooks do not compare."""
        self._say(f"{PERF_PREFIX} {text.format(value=value, **fields)}")
        return self.record(name, value)

    def append(self, name: str, row: Any) -> Any:
        """Append `row` to the list recorded under `name` (a table a lesson builds row by row); returns it."""
        self.results.setdefault(name, []).append(_plain(row))
        return row

    def recorded(self, name: str) -> Any:
        """The value recorded under `name` (a KeyError names it when nothing was)."""
        return self.results[name]

    def claim(
        self,
        name: str,
        value: float,
        relation: str,
        bound: float,
        text: str,
        perf: bool = False,
        **fields: Any,
    ) -> bool:
        """State a claim, measured: print the sentence with its value and bound, record it, return whether it holds.

        Args:
            name: the claim's key in `results["claims"]` (snake_case, says what holds: "ddp_equals_one_process").
            value: the measured number (int, float or bool; a 0-d tensor is converted).
            relation: "<=", ">=" or "==": the claim is `value relation bound`.
            bound: the number the lesson holds itself to, written next to the sentence that states it.
            text: the sentence, a plain string (not an f-string) with `{value}`, optionally `{bound}`, and any
                of `fields` as placeholders: "{ranks} ranks agree to {value:.1e}", ranks=4.
            perf: the value depends on timing: print the line as `[perf]` (a notebook does not compare it).
            fields: the other numbers and names the sentence shows, formatted into it.

        Raises:
            ValueError: an unknown relation, or a name already claimed (a claim is recorded once).
        """
        value = _plain(value)
        if name in self.results["claims"]:
            raise ValueError(f"claim {name!r} is recorded twice")
        ok = holds(value, relation, bound)
        sentence = text.format(value=value, bound=bound, **fields)
        self.results["claims"][name] = {
            "value": value,
            "bound": bound,
            "relation": relation,
            "holds": ok,
            "text": sentence,
        }
        line = f"{sentence}  [claim {relation} {_bound_text(bound)}: {'holds' if ok else 'DOES NOT HOLD'}]"
        self._say(f"{PERF_PREFIX} {line}" if perf else line)
        return ok

    def write(self, path: str | Path | None) -> None:
        """Rank 0 writes `results` as JSON, atomically; a no-op when `path` is None or off rank 0."""
        if path is None or not self.master:
            return
        text = json.dumps(self.results, indent=2, sort_keys=True, default=_plain) + "\n"
        atomic_write(path, lambda f: f.write(text.encode()))

    def failing(self) -> list[str]:
        """The names of the recorded claims that do not hold, in the order they were claimed."""
        return [name for name, c in self.results["claims"].items() if not c["holds"]]

    def finish(self, path: str | Path | None) -> int:
        """A lesson's last call: `write` the results, print the tally on rank 0, and set the exit status.

        The last line says "12 checks hold", or "2 of 12 checks do not hold: name1, name2". When a claim does
        not hold, `common.harness.session.run_main` ends every rank with status 1 (torchrun then reports a failure too);
        the process group is destroyed first, on the normal path out of `distributed_session`. Rank 0's claims
        decide, for every rank: they are the ones printed and written (a claim that only rank 0 can measure, an
        error message it caught, is recorded on the other ranks with a placeholder). With a process group this
        is a collective (every rank calls it). Returns the status, 0 or 1.
        """
        self.write(path)
        failing, total = self.failing(), len(self.results["claims"])
        if failing:
            self._say(f"{len(failing)} of {total} checks do not hold: {', '.join(failing)}")
        else:
            self._say(f"{total} checks hold")
        status = 1 if failing else 0
        if (
            self.info is not None
            and self.info.distributed
            and dist.is_available()
            and dist.is_initialized()
        ):
            t = torch.tensor([status], dtype=torch.int64, device=self.info.device)
            dist.broadcast(t, src=0)  # rank 0's verdict, on every rank
            status = int(t.item())
        set_exit_status(status)
        return status
