"""minimal/14 held to lesson 14: the same HSDP bytes per step in each collective (the same model shapes on the
same 2 x 2 mesh; the minimal script accumulates k = 2 micro-steps, so it all-gathers twice as often and
reduces as often), eager's values after meta-device init, and one process's parameters within the lesson's
bound. The lesson's launch is its test's and notebook's default (one launch for all three)."""

from __future__ import annotations

import json

import pytest

from common.run.launch import run_lesson
from common.run.processes import REPO_ROOT
from tests._lessons import DEV

CPU = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.timeout(600)
def test_14_hsdp_bytes_meta_init_and_accumulation_are_lesson_14s():
    lesson = run_lesson("14_fsdp2_in_practice", 4, DEV, 300).check().results["claims"]
    run = run_lesson(
        REPO_ROOT / "minimal" / "14_fsdp2_in_practice.py", 4, [], 300, env=CPU, results=False
    ).check()
    (got,) = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    moved = got["bytes_per_step"]
    assert moved["all_gather_single"] == 2 * lesson["hsdp_all_gather_single_bytes"]["value"]
    assert moved["reduce_scatter_single"] == lesson["hsdp_reduce_scatter_single_bytes"]["value"]
    assert moved["all_reduce"] == lesson["hsdp_all_reduce_bytes"]["value"]
    assert got["init_diff"] == lesson["meta_init_equals_eager"]["value"] == 0.0
    assert got["max_diff"] <= lesson["accumulation_equals_one_process"]["bound"]
