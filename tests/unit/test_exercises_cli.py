"""`python -m exercises` as a learner runs it: the untouched stubs fail and are each named (no process is
started for a stub), an unknown name is one line and exit 2, and one reference solution passes."""

from __future__ import annotations

import subprocess
import sys

from common.run.launch import REPO_ROOT
from exercises import EXERCISES


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "exercises", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_untouched_stubs_fail_and_each_is_named():
    r = run()
    assert r.returncode == 1, r.stdout + r.stderr
    for name in EXERCISES:
        assert f"FAIL  {name} (lesson {EXERCISES[name][0]})" in r.stdout, r.stdout
    assert r.stdout.count("not solved yet") == len(EXERCISES)
    assert f"0 of {len(EXERCISES)} exercises pass" in r.stdout


def test_unknown_exercise_is_one_line_and_exit_2():
    r = run("ring_all_reduce")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown exercise" in r.stderr, (
        r.stderr
    )


def test_a_reference_solution_passes_from_the_command_line():
    r = run("--reference", "distributed_sampler", "one_f_one_b")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all 2 exercises pass" in r.stdout


def test_list_names_every_exercise_with_its_lesson():
    r = run("--list")
    assert r.returncode == 0 and all(name in r.stdout for name in EXERCISES)
