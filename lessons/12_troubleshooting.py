"""Lesson 12: troubleshooting -- reproduced failures, each with its symptom, its diagnosis and its fix.

Run it:

    python lessons/12_troubleshooting.py --list                      # the exhibits, their causes and lessons
    python lessons/12_troubleshooting.py --index                     # docs/symptoms.md's table (markdown)
    torchrun --standalone --nproc_per_node=2 lessons/12_troubleshooting.py --show rank_skips_step
    torchrun --standalone --nproc_per_node=2 lessons/12_troubleshooting.py --show collectives   # a group
    torchrun --standalone --nproc_per_node=2 lessons/12_troubleshooting.py --show all
    python lessons/12_troubleshooting.py --show training             # one process: what needs no second rank

What to look for:
- Each exhibit prints `symptom:` (the broken version, run as a user runs it, and what the user sees: the error
  text or the wrong number), `diagnosis:` (the step that reveals the cause) and `fix:` (the right version and
  its result), and records its claims (`<exhibit>_<what>`) in --results.
- Nothing hangs: a broken collective runs in a fresh gloo group bounded by --timeout-s (2 s) and raises
  "Timed out waiting 2000ms ..." where a real job would wait for 30 (gloo) or 10 (NCCL) minutes. The lesson's
  own bookkeeping (gathering each rank's outcome to rank 0) runs on the default group with a 120 s
  timeout, so a broken exhibit never poisons the next one. Failures that kill a process (gloo's
  size-mismatch abort), launcher mistakes and a second job run as separate launches with a timeout
  (common.run.processes.run_command).
- Every count follows the world size: rank 0 (or the last rank) plays the odd one out, the others alike.
- The symptom index (docs/symptoms.md, docs/zh/symptoms.md) maps each error text to its cause, its fix (the
  exhibit's own fix step), its exhibit and the lesson that teaches the right way, and lists the texts
  it cannot reproduce on CPU (NCCL's own, CUDA_VISIBLE_DEVICES, Windows), each with its source.
  Notebook 12 adds how to diagnose a hang: a stack of every rank (py-spy dump, faulthandler) from a real,
  bounded hang, the flight recorder (on by default, gloo's collectives too) and the GPU-only NCCL_DEBUG.

Sources: https://pytorch.org/docs/stable/distributed.html#debugging-torch-distributed-applications
(TORCH_DISTRIBUTED_DEBUG, monitored_barrier, TORCH_CPP_LOG_LEVEL),
https://pytorch.org/docs/stable/notes/ddp.html,
https://pytorch.org/docs/stable/elastic/run.html (rendezvous, --standalone),
https://pytorch.org/tutorials/prototype/flight_recorder_tutorial.html (the flight recorder).
"""

from __future__ import annotations

import argparse
import re
import textwrap
import time
from pathlib import Path

from common.exhibits.frame import GROUPS, load_exhibits, run_exhibit
from common.harness.env import LessonError
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main

# the default group only gathers outcomes; the exhibits get --timeout-s
BOOKKEEPING_TIMEOUT_S = 120.0
LESSONS_DIR = Path(__file__).resolve().parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--list", action="store_true", help="list the exhibits and exit")
    p.add_argument(
        "--index", action="store_true", help="print the symptom index (a markdown table) and exit"
    )
    p.add_argument(
        "--show",
        default=None,
        metavar="NAME",
        help=f"an exhibit's name, a group ({', '.join(GROUPS)}) or 'all'",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="every exhibit seeds its own models from this"
    )
    p.add_argument(
        "--results",
        default=None,
        help="rank 0 writes the claims of every exhibit shown here as JSON",
    )
    add_distributed_args(p, timeout_s=2.0)  # --timeout-s bounds each broken collective
    args = p.parse_args(argv)
    exhibits = load_exhibits()
    if args.list + args.index + (args.show is not None) != 1:
        raise LessonError(
            "give exactly one of --list, --index or --show NAME (see --list for the names)"
        )
    if args.show is not None and args.show not in {*exhibits, *GROUPS, "all"}:
        raise LessonError(
            f"--show {args.show}: no such exhibit or group; --list shows the "
            f"{len(exhibits)} exhibits, groups are {', '.join(GROUPS)}, or all"
        )
    if not 0.5 <= args.timeout_s <= 60:
        raise LessonError(
            f"--timeout-s must be between 0.5 and 60 s here (each "
            f"broken version waits that long), got {args.timeout_s}"
        )
    return args


def list_exhibits() -> None:
    """Per exhibit: a line with its name, group and the lesson that teaches the right way, then its cause."""
    for ex in load_exhibits().values():
        print(f"{ex.name:34s} {ex.group:12s} lesson {ex.lesson}")
        print(textwrap.fill(ex.cause, 120, initial_indent="    ", subsequent_indent="    "))


def lesson_topics(folder: Path = LESSONS_DIR) -> dict[str, str]:
    """{"03": "DistributedDataParallel (DDP)", ...}: every lesson in the tree, with the topic its docstring's
    first line names ('Lesson 03: <topic> -- ...' or 'Lesson 13: <topic>: ...')."""
    topics = {}
    for path in sorted(folder.glob("[0-9][0-9]_*.py")):
        first = path.read_text().split("\n", 1)[0]
        match = re.match(r'"""Lesson \d+: (.+?)(?: --|:|$)', first)
        topics[path.name[:2]] = match.group(1) if match else path.stem[3:].replace("_", " ")
    return topics


def symptom_index() -> str:
    """docs/symptoms.md's table: what you see (the error text, and when it shows) -> cause -> fix -> exhibit
    -> the lesson that teaches the right way."""
    topics = lesson_topics()
    rows = ["| what you see | cause | fix | exhibit | the right way |", "|---|---|---|---|---|"]
    for ex in load_exhibits().values():
        if ex.lesson not in topics:
            raise LessonError(f"exhibit {ex.name}: no lesson {ex.lesson} in {LESSONS_DIR}")
        # a pipe ends a cell
        symptom, when, cause, fix = (
            text.replace("|", "\\|") for text in (ex.symptom, ex.when, ex.cause, ex.fix)
        )
        seen = " ".join(filter(None, (f"`{symptom}`" if symptom else "", when)))
        lesson = f"lesson {ex.lesson}: {topics[ex.lesson]}"
        rows.append(f"| {seen} | {cause} | {fix} | `{ex.name}` | {lesson} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.index:  # before --list when both are given
        print(symptom_index())
        return
    if args.list:
        list_exhibits()
        return
    exhibits = load_exhibits()
    chosen = [ex for ex in exhibits.values() if args.show in (ex.name, ex.group, "all")]
    session_args = argparse.Namespace(**{**vars(args), "timeout_s": BOOKKEEPING_TIMEOUT_S})
    with distributed_session(session_args) as info:
        report = Report(info)
        report.value(
            "world_size",
            info.world_size,
            "world_size {value}; each broken collective is bounded by --timeout-s {timeout:g} s",
            timeout=args.timeout_s,
        )
        report.record("timeout_s", args.timeout_s)
        report.record("shown", [ex.name for ex in chosen])
        for ex in chosen:
            t0 = time.perf_counter()
            run_exhibit(ex, info, report, args.timeout_s)
            report.perf(f"{ex.name}_s", time.perf_counter() - t0, "{ex}: {value:.1f} s", ex=ex.name)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
