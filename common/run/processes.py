"""A command in a process group of its own, with a timeout: when it passes, the command and every process below it
are killed (torchrun starts each rank in a session of its own, so killing its group does not reach them) and
LessonTimeout is raised; and the CPU seconds its children used."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

__all__ = ["REPO_ROOT", "LessonTimeout", "run_command", "children_cpu_s", "launch_env"]


REPO_ROOT = Path(__file__).resolve().parents[2]


class LessonTimeout(RuntimeError):
    """A launched lesson did not finish within its timeout; it was killed. `.output` holds what it printed."""

    def __init__(self, message: str, output: str):
        super().__init__(message)
        self.output = output


def launch_env(env: dict | None) -> dict:
    """The environment a launched command sees: ours, one thread per process, unbuffered; `env` overrides."""
    e = dict(os.environ)
    # One thread per process: 2 processes on 2 cores must not each start 2 OpenMP threads. torchrun sets this
    # only when nproc > 1; setting it always also makes 1-process numbers reproducible (reduction order).
    # Pass env={"OMP_NUM_THREADS": ...} to override, or None to remove a variable.
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONUNBUFFERED"] = "1"
    e.update(env or {})
    return {k: v for k, v in e.items() if v is not None}


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc; elsewhere none): torchrun starts each rank in a session of its
    own, so killing torchrun's process group does not reach them."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def run_command(
    cmd: Sequence[str],
    timeout_s: float = 120,
    env: dict | None = None,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess:
    """Run `cmd` in its own process group; on timeout kill it and every process below it, and raise
    LessonTimeout."""
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=launch_env(env),
        cwd=cwd or REPO_ROOT,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *_descendants(proc.pid)]:  # torchrun and every rank it started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise LessonTimeout(f"{' '.join(cmd)} did not finish in {timeout_s} s", out + err) from None
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's finished children and theirs: torchrun and its ranks."""
    try:
        import resource  # Unix only
    except ImportError:
        return 0.0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
