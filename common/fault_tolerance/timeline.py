"""The timeline of a run that survives its faults (lesson 16), read from the `events.jsonl` every rank appends to:
which steps were trained twice, how long the restart took, how much work was lost; and its picture."""

from __future__ import annotations

import json
from pathlib import Path

from common.fault_tolerance.faults import read_error_file

__all__ = ["read_events", "timeline", "report_timeline", "plot_restart_timeline"]


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
