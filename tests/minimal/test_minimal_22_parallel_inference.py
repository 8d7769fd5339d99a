"""minimal/22_parallel_inference.py held to lesson 22: launched as users launch it at tp = 2, its generated
tokens are the lesson's (the same seed, prompts and model), its logits within the lesson's bound, and its
cache is the lesson's bytes a rank."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from common.run.launch import run_lesson
from common.run.processes import REPO_ROOT

CPU = {"CUDA_VISIBLE_DEVICES": ""}
TOL = importlib.import_module("lessons.22_parallel_inference").TOL  # the lesson's logits bound


@pytest.mark.timeout(480)
def test_minimal_22_generates_the_lessons_tokens_with_the_lessons_cache():
    lesson = run_lesson("22_parallel_inference", nproc=2, timeout_s=300).check().results
    run = run_lesson(
        REPO_ROOT / "minimal" / "22_parallel_inference.py", 2, [], 180, env=CPU, results=False
    ).check()
    (got,) = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert got["tp"] == 2
    assert got["tokens"] == lesson["tokens"]
    gap = (torch.tensor(got["logits"]) - torch.tensor(lesson["logits"])).abs().max().item()
    assert gap <= TOL, f"minimal's logits differ from the lesson's by {gap:.2e} > {TOL}"
    assert got["cache_bytes"] == lesson["cache_bytes"][0]
