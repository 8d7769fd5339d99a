"""common.run.launch_cache: a configuration is launched once per session, a path or a timeout is never shared,
and a changed source file, argument or environment variable launches afresh."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import pytest

from common.run import launch_cache
from common.run.processes import REPO_ROOT, LessonTimeout

LESSON = REPO_ROOT / "lessons" / "04_custom_sampler.py"


def fake_launch(calls: list, wall_s: float = 0.0):
    def launch():
        calls.append(1)
        time.sleep(wall_s)
        return {
            "command": ["x"],
            "returncode": 0,
            "stdout": f"run {len(calls)}",
            "stderr": "",
            "results": None,
            "wall_s": wall_s,
            "cpu_s": 0.0,
        }

    return launch


def key(args=(), env=None, nproc=2, results=True, root=REPO_ROOT):
    return launch_cache.config_key(root, LESSON, nproc, list(args), env, results)


def test_the_key_follows_every_part_of_the_configuration():
    base = key(["--device", "cpu"])
    assert base == key(["--device", "cpu"])
    cpu = ["--device", "cpu"]
    others = [
        key([*cpu, "--epochs", "1"]),
        key(["cpu", "--device"]),
        key(cpu, nproc=4),
        key(cpu, nproc=None),
        key(cpu, env={"CUDA_VISIBLE_DEVICES": ""}),
        key(cpu, results=False),
    ]
    assert len({base, *others}) == 1 + len(others)


def test_a_changed_source_line_changes_the_key(tmp_path):
    for d in launch_cache.SOURCE_DIRS:
        (tmp_path / d).mkdir()
    module = tmp_path / "common" / "m.py"
    module.write_text("x = 1\n")
    before = launch_cache.config_key(tmp_path, LESSON, 2, [], None, True)
    module.write_text("x = 2\n")
    launch_cache._sources_digest.cache_clear()  # a new process reads the sources afresh
    assert launch_cache.config_key(tmp_path, LESSON, 2, [], None, True) != before


def test_arguments_that_name_a_path_are_never_shared():
    assert launch_cache.shareable(["--device", "cpu", "--steps", "20", "--show", "collectives"])
    assert not launch_cache.shareable(["--checkpoint", "/tmp/x/ckpt.pt"])
    assert not launch_cache.shareable(["--data", "data/mnist"])


def test_one_launch_then_shared_and_logged(tmp_path):
    calls = []
    first = launch_cache.shared_launch(tmp_path, "k", {"file": "f"}, 10, fake_launch(calls))
    second = launch_cache.shared_launch(tmp_path, "k", {"file": "f"}, 10, fake_launch(calls))
    other = launch_cache.shared_launch(tmp_path, "k2", {"file": "f"}, 10, fake_launch(calls))
    assert len(calls) == 2 and first == second and other["stdout"] == "run 2"
    assert [r["shared"] for r in launch_cache.read_log(tmp_path)] == [False, True, False]


def test_a_timed_out_launch_is_not_stored(tmp_path):
    def times_out():
        raise LessonTimeout("did not finish", "")

    with pytest.raises(LessonTimeout):
        launch_cache.shared_launch(tmp_path, "k", {}, 10, times_out)
    calls = []
    launch_cache.shared_launch(tmp_path, "k", {}, 10, fake_launch(calls))
    assert calls == [1]  # launched again


@pytest.mark.timeout(60)
def test_a_second_caller_waits_for_the_first_and_reads_its_run(tmp_path):
    calls, got = [], []
    threads = [
        threading.Thread(
            target=lambda: got.append(
                launch_cache.shared_launch(tmp_path, "k", {}, 30, fake_launch(calls, wall_s=0.5))
            )
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and got[0] == got[1]


def test_the_variable_unset_or_off_launches_every_call(monkeypatch):
    monkeypatch.delenv(launch_cache.CACHE_ENV, raising=False)
    assert launch_cache.cache_dir() is None
    monkeypatch.setenv(launch_cache.CACHE_ENV, "off")
    assert launch_cache.cache_dir() is None


def test_only_a_directory_a_test_session_made_is_used(monkeypatch, tmp_path):
    monkeypatch.setenv(launch_cache.CACHE_ENV, str(tmp_path))  # set by hand: not a session's
    assert launch_cache.cache_dir() is None
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # made under tmp_path, removed with it
    made = launch_cache.make_session_dir()
    monkeypatch.setenv(launch_cache.CACHE_ENV, made)
    assert launch_cache.cache_dir() == Path(made)


def test_an_inherited_variable_that_can_change_a_launch_changes_the_key(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    before = key()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert key() != before
    monkeypatch.setenv(
        "PYTEST_CURRENT_TEST", "another test"
    )  # cannot change a launch: not in the key
    assert key() == key()


def test_a_shared_run_longer_than_the_callers_timeout_is_its_timeout(monkeypatch, tmp_path):
    from common.run import launch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = launch_cache.make_session_dir()
    monkeypatch.setenv(launch_cache.CACHE_ENV, made)
    calls = []

    def slow(*args):
        calls.append(1)
        return {
            "command": ["x"],
            "returncode": 0,
            "stdout": "",
            "stderr": "",
            "results": None,
            "wall_s": 50.0,
            "cpu_s": 0.0,
        }

    monkeypatch.setattr(launch, "_launch", slow)
    assert launch.run_lesson("04_custom_sampler", 2, [], timeout_s=100).wall_s == 50.0
    with pytest.raises(LessonTimeout):
        launch.run_lesson(
            "04_custom_sampler", 2, [], timeout_s=10
        )  # the same configuration, a tighter bound
    launch.run_lesson("04_custom_sampler", 2, [], timeout_s=100, share=False)
    assert len(calls) == 2  # the first launch, and the one that asked not to share
