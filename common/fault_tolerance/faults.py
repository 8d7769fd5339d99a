"""Injected faults and the timeline of a run that survives them (lesson 16).

A fault is `KIND@STEP[:RANK]`; the i-th fault of a list fires in torchrun's attempt i only
(`common.harness.rendezvous.attempt()` = i, agreed by every node), so the restarted job does not fail again there:

    exit@7:1           rank 1 calls os._exit(1) during step 7 (after its forward): no cleanup, no exception
    raise@7:1          rank 1 raises InjectedFault in step 7: `@record` on main writes its error file
    hang@7:1           rank 1 sleeps forever during step 7: its peers wait in the all-reduce until --timeout-s
    mid-write@8        the writer (global rank 0) dies after writing half of step 8's checkpoint
    before-rename@8    the writer dies after writing all of it, before the temp file is renamed

Every rank appends what happens to `events.jsonl` beside the checkpoints (one JSON line per event, with
time.time(): comparable across processes of one machine; across nodes the clocks may differ by their skew).
`timeline` turns those lines into what a reader asks after a crash: which steps were trained twice, how long
the restart took, how much work was lost.
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
    "read_events",
    "timeline",
    "report_timeline",
    "plot_restart_timeline",
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


def read_events(path: str | Path) -> list[dict]:
    path = Path(path)
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if path.is_file()
        else []
    )


def timeline(events: list[dict]) -> dict:
    """Per attempt: steps trained, where it resumed from, its fault; over the run: the steps trained twice
    (`steps_redone`, deterministic) and, from the clocks, `restart_s` (fault -> first step of the next attempt)
    and `lost_work_s` (last complete checkpoint -> fault), the two costs a checkpoint interval trades."""
    attempts: dict[int, dict] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        a = attempts.setdefault(
            e["attempt"],
            {
                "attempt": e["attempt"],
                "steps": [],
                "step_t": [],
                "losses": [],
                "saves": [],
                "resumed_from": None,
                "ignored": [],
                "fault": None,
                "start_t": None,
                "peer_failure_t": None,
            },
        )
        if (
            e["kind"] == "start" and e["rank"] == 0
        ):  # every rank logs its start; rank 0's marks the attempt
            a["start_t"] = e["t"]
        elif e["kind"] == "resume":
            a["resumed_from"], a["ignored"] = e["step"], e["ignored"]
        elif (
            e["kind"] == "step" and e["rank"] == 0
        ):  # every rank logs its steps and saves: rank 0's count
            a["steps"].append(e["step"])
            a["step_t"].append(e["t"])
            a["losses"].append(e["loss"])
        elif e["kind"] == "peer-failure" and a["peer_failure_t"] is None:
            a["peer_failure_t"] = e["t"]
        elif e["kind"] == "save" and e["rank"] == 0:
            a["saves"].append((e["step"], e["t"]))
        elif e["kind"] == "fault":
            a["fault"] = {k: e.get(k) for k in ("fault", "step", "rank", "t", "error_file")}
    runs = [attempts[k] for k in sorted(attempts)]
    redone, restart_s, lost_s = [], [], []
    for a, b in zip(runs, runs[1:]):
        redone.append(sorted(set(a["steps"]) & set(b["steps"])))
        t_fail = (
            a["fault"]["t"] if a["fault"] else (a["step_t"][-1] if a["step_t"] else a["start_t"])
        )
        if b["step_t"]:
            restart_s.append(b["step_t"][0] - t_fail)
        last_save = [t for s, t in a["saves"] if s == b["resumed_from"]]
        lost_s.append(t_fail - (last_save[0] if last_save else a["start_t"]))
    return {"attempts": runs, "steps_redone": redone, "restart_s": restart_s, "lost_work_s": lost_s}


def report_timeline(report, events: list[dict]) -> dict:
    """Rank 0: record the timeline; print per restart where it resumed and the steps trained twice (values), and
    the seconds it cost ([perf]: hang detection, restart, work lost)."""
    tl = report.record("timeline", timeline(events))
    for a, redone in zip(tl["attempts"][1:], tl["steps_redone"]):
        if a["resumed_from"] is not None:
            where = "resumed from step {value[from]}"
        else:
            where = "found no complete checkpoint and started from scratch"
        report.value(
            f"resume_{a['attempt']}",
            {"from": a["resumed_from"], "ignored": len(a["ignored"]), "redone": redone},
            "attempt {attempt} " + where + " (removed {value[ignored]} leftover "
            "files of killed saves, never loaded), trained steps {value[redone]} again",
            attempt=a["attempt"],
        )
    for a in tl["attempts"]:  # what torchrun's summary would quote, read from the rank that raised
        f = a["fault"]
        if f and f["fault"] == "raise":
            message = (
                read_error_file(f["error_file"]) or "(not readable here: it is on that rank's node)"
            )
            report.value(
                f"error_file_{a['attempt']}",
                {"rank": f["rank"], "message": message},
                "attempt {attempt}: rank {value[rank]}'s error file, written by @record: "
                "{value[message]}",
                attempt=a["attempt"],
            )
    for i, (a, restart, lost) in enumerate(zip(tl["attempts"], tl["restart_s"], tl["lost_work_s"])):
        hang = (
            f", a hung peer detected in {a['peer_failure_t'] - a['fault']['t']:.1f} s"
            if a["fault"] and a["fault"]["fault"] == "hang" and a["peer_failure_t"]
            else ""
        )
        report.perf(
            f"restart_s_{i}",
            restart,
            "attempt {attempt}: {value:.1f} s to restart, {lost:.1f} s of work lost{hang}",
            attempt=i,
            lost=lost,
            hang=hang,
        )
    return tl


def plot_restart_timeline(tl: dict, ax=None):
    """Step against wall time, one colour per attempt; lost work and restart time shaded."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(8, 3.2))[1]
    runs = tl["attempts"]
    t0 = min(a["start_t"] or a["step_t"][0] for a in runs)
    for a in runs:
        ax.plot([t - t0 for t in a["step_t"]], a["steps"], ".-", label=f"attempt {a['attempt']}")
        for s, t in a["saves"]:
            ax.plot(t - t0, s, "ks", ms=4)
        if a["fault"]:
            f = a["fault"]
            ax.plot(f["t"] - t0, f["step"], "rx", ms=10, mew=2)
    for a, _b, lost, restart in zip(runs, runs[1:], tl["lost_work_s"], tl["restart_s"]):
        t_fail = (a["fault"] or {"t": a["step_t"][-1]})["t"] - t0
        ax.axvspan(
            t_fail - lost,
            t_fail,
            color="tab:red",
            alpha=0.15,
            label="lost work (since the checkpoint)",
        )
        ax.axvspan(
            t_fail,
            t_fail + restart,
            color="tab:gray",
            alpha=0.2,
            label="restart (detect, respawn, load)",
        )
    ax.set(xlabel="wall time (s)", ylabel="global step", title="a crash and its restart")
    ax.legend(fontsize=8, loc="upper left")
    return ax
