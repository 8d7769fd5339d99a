"""minimal/17_performance.py held to lesson 17: launched as users launch it on 2 ranks, the bucket all-reduces
its profiler trace shows per step are as many as the lesson's profile counts at bucket_cap_mb 1 (DDP's rule,
predicted), and they carry the bytes of every gradient once: the lesson's param_bytes, and the bytes its
bucket_cap_mb=1.0 row counted from the collectives DDP issued."""

import json

import pytest

from common.run.launch import run_lesson
from common.run.processes import REPO_ROOT

CPU = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.timeout(600)
def test_minimal_17_counts_the_lessons_buckets_and_bytes():
    run = run_lesson(
        REPO_ROOT / "minimal" / "17_performance.py", 2, [], 240, env=CPU, results=False
    )
    (got,) = [json.loads(line) for line in run.check().stdout.splitlines() if line.startswith("{")]
    # the 2-rank launch without section 3 (torch.compile): the profile and the knobs are what is compared
    lesson = run_lesson("17_performance", 2, ["--compile-backend", "none"], 480).check().results
    profile = lesson["claims"]["profile_allreduces_equal_buckets_cap_1mb"]
    assert profile["holds"] and profile["value"] == 0
    (row,) = [k for k in lesson["knobs"] if k["knob"] == "bucket_cap_mb=1.0"]
    buckets = lesson["calls_cap_1.0"][-1]  # after DDP rebuilt its buckets: the profiled steps
    assert buckets == 3 and f"{buckets} bucket(s)" in profile["text"]
    assert [r["rank"] for r in got["ranks"]] == [0, 1]
    for r in got["ranks"]:
        assert r["allreduces"] == buckets, r
        assert r["bytes"] == got["param_bytes"] == lesson["param_bytes"] == row["bytes"], r
        assert all(0 < b <= 1.1 * 2**20 for b in r["bucket_bytes"]), (
            r
        )  # each near bucket_cap_mb or less
