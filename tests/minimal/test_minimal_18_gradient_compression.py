"""minimal/18_gradient_compression.py held to lesson 18: launched as users launch it on 2 ranks, its fp16 hook
equals PyTorch's bit for bit and halves the bytes, its PowerSGD sends the numbers lesson 18's accounting
(common.compression.powersgd) predicts for its model, and its resume is exact only with the hook's state: the
values the lesson's claims hold (the lesson's 2-rank launch is the one its test and notebook share)."""

import json

import pytest
import torch

from common.compression.powersgd import powersgd_numel
from common.run.launch import run_lesson
from common.run.processes import REPO_ROOT

CPU = {"CUDA_VISIBLE_DEVICES": ""}
SHAPES = [
    (256, 64),
    (256,),
    (10, 256),
    (10,),
]  # the script's model: Linear(64, 256), Linear(256, 10)


@pytest.mark.timeout(600)
def test_minimal_18_compresses_and_resumes_as_the_lesson_claims():
    run = run_lesson(
        REPO_ROOT / "minimal" / "18_gradient_compression.py", 2, [], 240, env=CPU, results=False
    ).check()
    (got,) = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    lesson = run_lesson("18_gradient_compression", nproc=2, timeout_s=480).check().results["claims"]
    assert got["fp16_vs_pytorch"] == lesson["fp16_hook_equals_pytorchs"]["value"] == 0.0
    assert 4 * numel - 2 * got["fp16_bytes"] == lesson["fp16_hook_halves_bytes"]["value"] == 0
    assert got["fp16_error"] <= lesson["fp16_error_within_rounding"]["bound"]
    assert got["powersgd_numbers"] == powersgd_numel(SHAPES, 1) < numel / 10
    assert got["resume_exact"] == lesson["powersgd_resume_exact"]["value"] == 0.0
    assert got["resume_without_hook_state"] > 1e-4
