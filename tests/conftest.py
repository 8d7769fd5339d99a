"""Shared test settings.

- hypothesis without deadlines (2 shared cores make timings noisy);
- every test under tests/lessons/ and tests/minimal/ and every notebook cell is marked `slow`: they launch
  lessons (and minimal/ scripts) under torchrun.
  `python -m pytest -m "not slow"` therefore runs the unit tests alone (tests/unit/, under a minute).
"""
import os
from pathlib import Path

import pytest
from hypothesis import settings

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
