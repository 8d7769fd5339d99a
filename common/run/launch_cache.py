"""One launch per lesson configuration in a test session: the suite's runs shared by tests and notebooks.

A lesson test, the notebook that explains the lesson and the minimal script's test often launch the very
same command (`torchrun --nproc_per_node=2 lessons/04_custom_sampler.py --device cpu`). In a `pytest`
session, tests/conftest.py makes a directory (marked as its own) and names it in `LESSONS_LAUNCH_CACHE`;
`common.run.launch.run_lesson` then launches each configuration once and gives every later caller that launch's
exit code, output and results. Outside a test session (a reader running a notebook) nothing is shared.

A configuration is the key: the content of every .py file under common/, lessons/, minimal/ and benchmarks/
and of data/ (a changed line launches afresh), the interpreter and torch version, the file launched, the
number of processes, the arguments, the environment overrides, the inherited variables that can change a
launch (CUDA_*, PET_*, TORCH*, NCCL_*, OMP_*, ...), and whether --results is asked for. A launch whose
arguments name a file or directory (a checkpoint to write, then resume) is never shared: a second run may
find what the first left. Nor is one that timed out. Two callers asking at once: the second waits for the
first (a lock per key), then reads its run; a run that took longer than a caller's own timeout is that
caller's timeout (common/run/launch.py). `run_lesson(..., share=False)` always launches (a benchmark that
repeats a command to time it).

Every call is logged to `launches.jsonl` in the directory (key, file, processes, arguments, seconds, shared or
not): tests/conftest.py prints how many launches the session made and how many it shared.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

try:
    import fcntl  # the lock per key; where there is none (Windows) nothing is shared
except ImportError:
    fcntl = None

__all__ = [
    "CACHE_ENV",
    "cache_dir",
    "make_session_dir",
    "shareable",
    "config_key",
    "shared_launch",
    "log_launch",
    "read_log",
]

CACHE_ENV = "LESSONS_LAUNCH_CACHE"
SOURCE_DIRS = ("common", "lessons", "minimal", "benchmarks")
MARKER = (
    "made-by-a-pytest-session"  # written by tests/conftest.py: a directory set by hand is not used
)
# environment variables a launch inherits that can change what it does (the rest, such as PYTEST_CURRENT_TEST
# or a notebook kernel's own, cannot): part of the key
ENV_PREFIXES = (
    "CUDA_",
    "HIP_",
    "ROCR_",
    "PET_",
    "TORCH",
    "NCCL_",
    "GLOO_",
    "OMP_",
    "MKL_",
    "KMP_",
    "MASTER_",
    "PYTHON",
    "LD_",
)
ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "PATH")


def cache_dir() -> Path | None:
    """The session's directory of shared launches, or None (unset, "off", or not made by a test session)."""
    value = os.environ.get(CACHE_ENV, "")
    if fcntl is None or value in ("", "0", "off") or not (Path(value) / MARKER).is_file():
        return None
    return Path(value)


def make_session_dir() -> str:
    """A fresh directory for one test session's launches (tests/conftest.py), marked as such."""
    directory = tempfile.mkdtemp(prefix="lesson-launches-")
    (Path(directory) / MARKER).write_text("one pytest session's shared lesson launches\n")
    return directory


def shareable(args: Sequence[str]) -> bool:
    """False when an argument names a path (contains a '/' or the OS separator): files make a run stateful."""
    return not any("/" in str(a) or os.sep in str(a) for a in args)


@functools.lru_cache(maxsize=4)
def _sources_digest(root: str) -> str:
    """One digest of every .py file the lessons can import or launch and of the data they read (read once per
    process), with the interpreter and the torch installed."""
    h = hashlib.sha256(f"{sys.executable}\0{_torch_version()}\0".encode())
    files = [f for d in SOURCE_DIRS for f in sorted((Path(root) / d).rglob("*.py"))]
    for f in files + sorted((Path(root) / "data").glob("*")):
        if f.is_file():
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _inherited_env() -> list:
    return sorted(
        (k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES
    )


def config_key(
    root: Path, path: Path, nproc: int | None, args: Sequence[str], env: dict | None, results: bool
) -> str:
    """The configuration's key: sources, launched file, processes, arguments, environment, --results."""
    config = {
        "sources": _sources_digest(str(root)),
        "file": str(Path(path).resolve()),
        "nproc": nproc,
        "args": [str(a) for a in args],
        "env": sorted((env or {}).items(), key=str),
        "results": results,
        "inherited": _inherited_env(),
    }
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:24]


def log_launch(directory: Path, record: dict) -> None:
    with open(
        directory / "launches.jsonl", "a"
    ) as f:  # one short line per write: appends do not interleave
        f.write(json.dumps(record) + "\n")


def read_log(directory: Path) -> list[dict]:
    """Every launch record of the session (empty when none was made)."""
    log = directory / "launches.jsonl"
    if not log.is_file():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _wait_for_lock(lock_file, timeout_s: float) -> bool:
    """Take the key's lock, waiting at most `timeout_s` while another caller launches; False if still held."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)


def shared_launch(
    directory: Path, key: str, label: dict, timeout_s: float, launch: Callable[[], dict]
) -> dict:
    """The run stored under `key`, or `launch()`'s run (a dict) stored there for the next caller.

    `launch` raises on a timeout: nothing is stored, and the next caller launches again.
    """
    stored = directory / f"{key}.json"
    t0 = time.monotonic()
    with open(directory / f"{key}.lock", "w") as lock_file:
        if not _wait_for_lock(lock_file, timeout_s):
            run = (
                launch()
            )  # the first caller is still at it after our own timeout: launch ourselves
        elif stored.is_file():
            run = json.loads(stored.read_text())
            log_launch(
                directory,
                {
                    **label,
                    "key": key,
                    "shared": True,
                    "wall_s": run["wall_s"],
                    "cpu_s": run["cpu_s"],
                    "waited_s": round(time.monotonic() - t0, 1),
                },
            )
            return run
        else:
            run = launch()
            tmp = stored.with_suffix(".tmp")
            tmp.write_text(json.dumps(run))
            os.replace(tmp, stored)  # atomic: a reader sees the whole run or none
    log_launch(
        directory,
        {**label, "key": key, "shared": False, "wall_s": run["wall_s"], "cpu_s": run["cpu_s"]},
    )
    return run
