"""Run a lesson the way a user does -- under torchrun, or as plain `python` -- from Python, with a timeout.

Notebooks and tests use this (introduced in lesson 01). It runs

    python -m torch.distributed.run --standalone --nproc_per_node=N lessons/NN_x.py ARGS --results TMP.json

(`python -m torch.distributed.run` is the `torchrun` console script, found without relying on PATH), waits at
most `timeout_s` seconds, kills the whole process tree if that passes, and returns the exit code, rank 0's
output and the JSON of numbers the lesson reported.

Lessons print run-dependent numbers (times, throughput, memory) on lines that start with `PERF_PREFIX`;
`LessonRun.show()` leaves them out so that a notebook cell's output is the same on every run (nbval compares
it), and `show(perf=True)` prints only them (in a cell marked `# NBVAL_IGNORE_OUTPUT`).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from common.harness.results import PERF_PREFIX
from common.run.launch_cache import cache_dir, config_key, log_launch, shareable, shared_launch
from common.run.processes import REPO_ROOT, LessonTimeout, children_cpu_s, run_command

__all__ = [
    "LessonRun",
    "lesson_path",
    "torchrun_command",
    "run_lesson",
]


@dataclass
class LessonRun:
    """The outcome of one launch.

    Attributes:
        command: the argv that was run.
        returncode: exit status (0 on success; torchrun returns 1 when any rank fails).
        stdout: everything printed to stdout (lessons print there on rank 0 only).
        stderr: everything printed to stderr (per-rank errors, torchrun's own messages).
        results: the JSON the lesson wrote with --results, or None.
        wall_s: wall-clock seconds of the whole launch.
        cpu_s: CPU seconds it used, every process of it together (Linux; 0.0 where unknown).
    """

    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    results: dict | None = None
    wall_s: float = 0.0
    cpu_s: float = 0.0

    def lines(self, perf: bool = False) -> list[str]:
        """stdout lines without the [perf] lines (default), or only the [perf] lines."""
        out = self.stdout.splitlines()
        return [line for line in out if line.startswith(PERF_PREFIX) == perf]

    def show(self, perf: bool = False) -> None:
        """Print the deterministic lines (default) or the [perf] lines."""
        print("\n".join(self.lines(perf)))

    def check(self) -> LessonRun:
        """Raise RuntimeError with the output when the run failed; return self otherwise."""
        if self.returncode != 0:
            raise RuntimeError(
                f"{' '.join(self.command)} exited with {self.returncode}\n"
                f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"
            )
        return self


def lesson_path(lesson: str | Path) -> Path:
    """'03_ddp', '03_ddp.py' or a path -> the lesson file. Raises FileNotFoundError if absent."""
    p = Path(lesson)
    if not p.suffix:
        p = p.with_suffix(".py")
    if not p.is_absolute() and not p.exists():
        p = REPO_ROOT / "lessons" / p.name
    if not p.is_file():
        raise FileNotFoundError(f"no lesson file {p}")
    return p


def torchrun_command(
    lesson: str | Path,
    nproc: int | None = 2,
    args: Sequence[str] = (),
    *,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
) -> list[str]:
    """The argv to launch `lesson` with `nproc` processes per node (None: plain `python lesson.py`).

    With nnodes > 1, run the same command on every node with the same `rdzv_endpoint` ("HOST:PORT"): the c10d
    rendezvous joins them into one world of nnodes * nproc ranks and numbers the nodes itself (torchrun
    ignores --node_rank with c10d). Each call draws a fresh --rdzv-id (run the SAME command on every node): a
    fixed id lets a second job with the same endpoint join the first (lesson 12, `second_job_joins_first`); on
    a cluster use the scheduler's job id ($SLURM_JOB_ID).
    """
    path = str(lesson_path(lesson))
    if nproc is None:
        return [sys.executable, path, *args]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += [
            f"--nnodes={nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_endpoint}",
            f"--rdzv-id=lessons-{uuid.uuid4().hex[:12]}",
        ]
    return [*cmd, path, *args]


def run_lesson(
    lesson: str | Path,
    nproc: int | None = 2,
    args: Sequence[str] = (),
    timeout_s: float = 120,
    env: dict | None = None,
    results: bool = True,
    share: bool = True,
) -> LessonRun:
    """Launch a lesson under torchrun with `nproc` processes (None: plain python) and wait for it.

    Args:
        lesson: "03_ddp" or a path to the file.
        nproc: processes on this node; None runs `python lesson.py` with no process group.
        args: the lesson's own command-line arguments.
        timeout_s: wall-clock limit; the process tree is killed after it.
        env: extra environment variables (a value of None removes the variable).
        results: append `--results TMP.json` and parse it into `LessonRun.results`.
        share: in a test session, reuse an identical earlier launch (False: always launch, e.g. to time it).

    In a test session (common/run/launch_cache.py) a configuration launched before -- the same sources, file,
    processes, arguments and environment, no path among the arguments -- is not launched again: the call
    returns that launch.

    Raises:
        LessonTimeout: the launch took longer than `timeout_s`.
    """
    path = lesson_path(lesson)
    directory = cache_dir()
    label = {
        "file": _relative(path),
        "nproc": nproc,
        "args": [str(a) for a in args],
        "timeout_s": timeout_s,
    }
    if directory is None or not share or not shareable(args):
        run = _launch(path, nproc, args, timeout_s, env, results)
        if directory is not None:  # counted, not shared: a path among the arguments, or share=False
            facts = {"key": None, "shared": False, "wall_s": run["wall_s"], "cpu_s": run["cpu_s"]}
            log_launch(directory, {**label, **facts})
        return LessonRun(**run)
    key = config_key(REPO_ROOT, path, nproc, args, env, results)
    launch = partial(_launch, path, nproc, args, timeout_s, env, results)
    run = shared_launch(directory, key, label, timeout_s, launch)
    # launched for a caller that allowed longer: past this caller's bound
    if run["wall_s"] > timeout_s:
        raise LessonTimeout(
            f"{' '.join(run['command'])} took {run['wall_s']:.0f} s, more than {timeout_s} s",
            run["stdout"] + run["stderr"],
        )
    return LessonRun(**run)


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _launch(
    path: Path,
    nproc: int | None,
    args: Sequence[str],
    timeout_s: float,
    env: dict | None,
    results: bool,
) -> dict:
    """One launch, as the fields of a LessonRun."""
    with tempfile.TemporaryDirectory() as tmp:
        res_path = Path(tmp) / "results.json"
        full_args = [*args, "--results", str(res_path)] if results else list(args)
        cmd = torchrun_command(path, nproc, full_args)
        t0, cpu0 = time.perf_counter(), children_cpu_s()
        proc = run_command(cmd, timeout_s, env)
        wall, cpu = time.perf_counter() - t0, children_cpu_s() - cpu0
        parsed = json.loads(res_path.read_text()) if results and res_path.is_file() else None
    return {
        "command": cmd,
        "returncode": proc.returncode,
        "stdout": proc.stdout,
        "stderr": proc.stderr,
        "results": parsed,
        "wall_s": wall,
        "cpu_s": cpu,
    }
