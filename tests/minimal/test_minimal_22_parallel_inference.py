"""minimal/22_parallel_inference.py held to lesson 22: launched as users launch it at tp = 2, its generated
tokens are the lesson's (the same seed, prompts and model), and its cache is the lesson's bytes a rank."""

from __future__ import annotations

import json

import pytest

from common.run.launch import REPO_ROOT, run_lesson

CPU = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.timeout(480)
def test_minimal_22_generates_the_lessons_tokens_with_the_lessons_cache():
    lesson = run_lesson("22_parallel_inference", nproc=2, timeout_s=300).check().results
    run = run_lesson(
        REPO_ROOT / "minimal" / "22_parallel_inference.py", 2, [], 180, env=CPU, results=False
    ).check()
    (got,) = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert got["tp"] == 2
    assert got["tokens"] == lesson["tokens"]
    assert got["cache_bytes"] == lesson["cache_bytes"][0]
