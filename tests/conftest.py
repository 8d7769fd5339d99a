"""Shared test settings.

- hypothesis without deadlines (2 shared cores make timings noisy);
- every test under tests/lessons/ and tests/minimal/ and every notebook cell is marked `slow`: they launch
  lessons (and minimal/ scripts) under torchrun.
  `python -m pytest -m "not slow"` therefore runs the unit tests alone (tests/unit/, under a minute).
"""

import gc
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import settings

from common.run import launch_cache

settings.register_profile("ci", deadline=None, max_examples=60, derandomize=True)
settings.register_profile("dev", deadline=None, max_examples=60)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

LESSON_TESTS = Path(__file__).resolve().parent / "lessons"
MINIMAL_TESTS = Path(__file__).resolve().parent / "minimal"


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if path.suffix == ".ipynb" or LESSON_TESTS in path.parents or MINIMAL_TESTS in path.parents:
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session):
    """Freeze what collection imported (torch, matplotlib, hypothesis, the test modules: about 500,000 objects),
    so that a garbage collection walks only what the tests make.

    Why: when the session ends, xdist's controller tells each worker to exit and execnet sends a worker that is
    still busy 5 s later a SIGINT. A worker spends its last seconds in pytest's full garbage collections; on a
    busy 2-core machine each took 3-4 s over those objects, the SIGINT landed inside hypothesis' gc callback,
    and the run ended with a PytestUnraisableExceptionWarning whose traceback ends in KeyboardInterrupt.
    """
    gc.collect()
    gc.freeze()


# ---- one launch per lesson configuration (common/run/launch_cache.py) ---------------------------------------
# The controller makes a fresh directory for the session before xdist starts its workers, so that the
# workers and the notebook kernels they start inherit LESSONS_LAUNCH_CACHE; it is removed when the session
# ends. Set LESSONS_LAUNCH_CACHE=off to launch every call.
_MADE_CACHE: list[str] = []


def pytest_configure(config):
    if hasattr(config, "workerinput") or os.environ.get(launch_cache.CACHE_ENV) in ("0", "off"):
        return  # an xdist worker uses its controller's directory
    directory = launch_cache.make_session_dir()
    os.environ[launch_cache.CACHE_ENV] = directory
    _MADE_CACHE.append(directory)


def pytest_unconfigure(config):
    for directory in _MADE_CACHE:
        shutil.rmtree(directory, ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    directory = launch_cache.cache_dir()
    records = launch_cache.read_log(directory) if directory and _MADE_CACHE else []
    if records:
        shared = [r for r in records if r["shared"]]
        launched_s = sum(r["wall_s"] for r in records if not r["shared"])
        saved_s = sum(r["wall_s"] for r in shared)
        terminalreporter.write_line(
            f"lesson launches: {len(records) - len(shared)} made ({launched_s:.0f} s), {len(shared)} shared "
            f"with an earlier identical launch ({saved_s:.0f} s not spent again)"
        )
