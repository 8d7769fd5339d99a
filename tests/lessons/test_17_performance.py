"""Lesson 17 (where the time goes): the profile's counts, each knob's counted effect, torch.compile's graph
split. One 2-rank launch and one plain-python launch, asserted many ways; no assertion reads a time (times are
[perf] lines; benchmarks/ddp_knobs.py measures them with their spread). The comm hooks are lesson 18's."""

from __future__ import annotations

import json

import pytest

from common.measure.profiling import load_trace, step_profiles
from common.run.launch import run_lesson
from tests._lessons import assert_claims, assert_fails_on_every_rank, assert_lines_fit

LESSON = "17_performance"
PARAM_BYTES = 2_182_184  # ResidualMLP(256, 4): 545,546 fp32 parameters
TWO_RANK_CLAIMS = {
    "profile_allreduces_equal_buckets_cap_1mb",
    "profile_allreduces_equal_buckets_cap_100mb",
    "backward_nodes_after_first_bucket_issued",
    "one_bucket_issued_after_last_node",
    "bucket_sweep_rows_off",
    "first_step_one_bucket",
    "static_graph_rebuilds_one_step_later",
    "grad_as_bucket_view_saves_one_gradient_copy",
    "no_sync_one_round_per_step",
    "compiled_graphs_equal_buckets",
    "compile_without_ddp_optimizer_one_graph",
    "compiled_graphs_follow_1mib_first_bucket",
    "compile_refuses_bucket_cap_below_1mb",
}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="module")
def two_ranks_run(traces):
    return run_lesson(LESSON, nproc=2, args=["--trace-dir", str(traces)], timeout_s=480).check()


@pytest.fixture(scope="module")
def two_ranks(two_ranks_run):
    return two_ranks_run.results


@pytest.fixture(scope="module")
def one_process_run():
    return run_lesson(LESSON, nproc=None, timeout_s=360).check()


@pytest.fixture(scope="module")
def one_process(one_process_run):
    return one_process_run.results


def _claims(r):
    return {name: c["value"] for name, c in r["claims"].items()}


@pytest.mark.timeout(600)
@pytest.mark.timeout(600)
def test_two_ranks_claims_hold(two_ranks_run, two_ranks):
    assert set(assert_claims(two_ranks, TWO_RANK_CLAIMS)) == TWO_RANK_CLAIMS
    assert two_ranks["world_size"] == 2 and two_ranks["param_bytes"] == PARAM_BYTES
    assert_lines_fit(two_ranks_run)


@pytest.mark.timeout(600)
def test_profile_counts_one_allreduce_per_bucket_on_every_rank(two_ranks, traces):
    """The trace files are written per rank, and re-read here they show 3 all-reduces per profiled step with
    bucket_cap_mb 1 and 1 with one bucket; the recorded timeline says the same and is well formed."""
    for cap, buckets in (("1", 3), ("100", 1)):
        for rank in (0, 1):
            path = traces / f"trace_rank{rank}_bucket_cap_{cap}mb.json"
            steps = step_profiles(load_trace(path))
            assert [len(s.allreduce) for s in steps] == [buckets] * 3, path
            assert all(s.backward_ops > 0 for s in steps)
            # opens in Perfetto / chrome://tracing
            assert "traceEvents" in json.loads(path.read_text())
        timeline = two_ranks["timeline"][f"{float(cap)}"]
        assert len(timeline) == 2  # one entry per rank, gathered on rank 0
        for rank_profile in timeline:
            assert rank_profile["summary"]["allreduces_per_step"] == [buckets] * 3
            for step in rank_profile["steps"]:
                f0, f1 = step["phases"]["forward"]
                b0, b1 = step["phases"]["backward"]
                assert f0 == 0.0 <= f1 <= b0 <= b1  # ms from the step's start, phases in order
                assert all(s <= e for s, e in step["allreduce"])
                assert 0.0 <= step["hidden_ms"] <= step["allreduce_ms"] + 1e-9
    c = _claims(two_ranks)
    assert (
        c["backward_nodes_after_first_bucket_issued"] >= 1
        and c["one_bucket_issued_after_last_node"] == 0
    )
    assert two_ranks["trace_files"] == [
        "trace_rank0_bucket_cap_100mb.json",
        "trace_rank0_bucket_cap_1mb.json",
    ]


@pytest.mark.timeout(600)
def test_bucket_cap_static_graph_and_no_sync_counts(two_ranks):
    r = two_ranks
    # first backward: one bucket; then DDP's rule (the default None has a 1 MiB first bucket, explicit 25 not)
    assert r["calls_cap_None"] == [1, 2, 2, 2]
    assert r["calls_cap_0.1"] == [1, 9, 9, 9] and r["calls_cap_1.0"] == [1, 3, 3, 3]
    assert r["calls_cap_25.0"] == r["calls_cap_100.0"] == [1, 1, 1, 1]
    assert r["calls_static_graph"] == [1, 1, 2, 2]
    c = _claims(r)
    assert c["no_sync_one_round_per_step"] == 2
    assert c["grad_as_bucket_view_saves_one_gradient_copy"] == PARAM_BYTES
    caps = [row for row in r["knobs"] if row["knob"].startswith("bucket_cap_mb")]
    assert [row["calls"] for row in caps] == [2, 9, 3, 1, 1] and {row["bytes"] for row in caps} == {
        PARAM_BYTES
    }


@pytest.mark.timeout(600)
def test_compile_splits_at_buckets(two_ranks):
    c = _claims(two_ranks)
    assert (
        c["compiled_graphs_equal_buckets"] == 3
        and c["compile_without_ddp_optimizer_one_graph"] == 1
    )
    # [graphs, DDP's buckets, DDP's rule with a 1 MiB first bucket]: an explicit 25 has no 1 MiB bucket in DDP
    assert two_ranks["compiled_graphs_by_cap"] == {
        "None": [2, 2, 2],
        "1.0": [3, 3, 3],
        "25.0": [2, 1, 2],
    }
    assert c["compile_refuses_bucket_cap_below_1mb"] == 1


@pytest.mark.timeout(400)
def test_options_outside_what_a_claim_needs_drop_the_claim_not_its_truth():
    """--bucket-cap-mb 25 gives this 2.2 MB model one bucket: no several-bucket claim; every claim made
    holds."""
    run = run_lesson(
        LESSON, nproc=2, args=["--bucket-cap-mb", "25", "--compile-backend", "none"], timeout_s=360
    ).check()
    claims = assert_claims(
        run.results,
        {"profile_allreduces_equal_buckets_cap_25mb", "one_bucket_issued_after_last_node"},
    )
    assert "backward_nodes_after_first_bucket_issued" not in claims
    assert "compiled_graphs_equal_buckets" not in claims
    assert "bucket_cap_mb 25 also gives one bucket: no overlap to show" in run.stdout


@pytest.mark.timeout(400)
def test_one_process_runs_without_communication(one_process_run, one_process):
    r = one_process
    claims = assert_claims(r, {"compiled_graphs_equal_buckets"})
    assert r["world_size"] == 1 and not set(claims) & (
        TWO_RANK_CLAIMS - {"compiled_graphs_equal_buckets"}
    )
    assert r["trace_files"] == ["trace_rank0.json"]
    assert r["timeline"]["None"][0]["summary"]["allreduces_per_step"] == [0, 0, 0]
    assert r["knobs"] == []
    assert_lines_fit(one_process_run)


@pytest.mark.timeout(240)
def test_bad_input_fails_on_every_rank():
    run = run_lesson(LESSON, nproc=2, args=["--profile-steps", "0"], timeout_s=180)
    assert_fails_on_every_rank(run, 2, "--batch and --profile-steps must be >= 1")
