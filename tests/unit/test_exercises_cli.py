"""`python -m exercises` as a learner runs it: the untouched stubs fail and are each named (no process is
started for a stub), an unknown name is one line and exit 2, and one reference solution passes."""

from __future__ import annotations

import subprocess
import sys

from common.run.processes import REPO_ROOT
from exercises import EXERCISES
from exercises.graders._common import zh_line


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
    assert r.stdout.count("（中文）还没有实现") == len(EXERCISES), "a Chinese line under each"
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


def test_each_kind_of_grader_message_gets_its_chinese_line_and_the_guide():
    """The Chinese line under a grader's English message names the kind of mistake and the guide to read."""
    kinds = {
        "rank 1 called 2 collective(s) and returned, while rank 0 waited ...: rank 1 skipped a "
        "collective": "少调用了一次集合通信",
        "rank 0: hung (no answer within 20 s)": "卡住了",
        "rank 0: RuntimeError: dist.all_reduce called: build it from isend/irecv": "不许调用集合通信",
        "rank 2: the grader's run of your code raised: KeyError: 3": "抛出了异常",
        "rank 1 holds [3, 5], expected [4, 4]: ...": "与参考实现不同",
        "something else": "未通过",
    }
    for problem, words in kinds.items():
        line = zh_line("ring_allreduce", "02", problem)
        assert words in line and "docs/zh/lessons/02_collectives.md" in line, (problem, line)
