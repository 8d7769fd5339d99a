"""Lesson 09: pipelined = unsplit (loss, gradients, parameters), the bubble, memory, uneven micro-batches, errors.

Each configuration is launched once per module; the pure schedule tests are in tests/unit/test_pipeline.py.
"""

from __future__ import annotations

import pytest

from common.run.launch import run_lesson
from tests._lessons import DEV, assert_claims, assert_fails_on_every_rank, assert_lines_fit

TOL = 1e-5
SCHEDULES = ["gpipe", "1f1b", "torch-gpipe", "torch-1f1b", "torch-interleaved-1f1b"]
EQUAL = {f"{s}_equals_unsplit" for s in SCHEDULES}
ALWAYS = {
    "naive_split_equals_unsplit",
    "naive_split_one_device_at_a_time",
    "peak_live_as_scheduled",
    "gpipe_activation_bytes_same_for_every_m",
    "1f1b_activation_bytes_fraction",
    "uneven_weighted_loss_equals_unsplit",
}
ACCUMULATION = {
    "schedule_steps_accumulate_g_over_m_plus_g",
    "schedule_steps_do_not_accumulate_2g",
    "scale_grads_false_accumulates",
}  # two ScheduleGPipe steps without zero_grad (torch's behaviour)
BUBBLE = {
    "naive_split_idle_fraction",
    "bubble_not_below_theory",
    "bubble_within_0.1_of_theory",
    "bubble_gap_grows_with_m",
    "interleaved_idles_less_than_1f1b",
}


def rows_of(results: dict) -> dict:
    """(schedule, m) -> the row the lesson recorded for that step."""
    return {(r["schedule"], r["m"]): r for k, r in results.items() if k.startswith("step_")}


def _check_rows(rows: dict, p: int, ms: list[int]) -> None:
    want = {
        (s, m)
        for s in SCHEDULES
        for m in ms
        if not (s == "torch-1f1b" and m < p) and not (s == "torch-interleaved-1f1b" and m % p)
    }
    assert set(rows) == want
    for (s, m), r in rows.items():
        assert r["max_diff"] < TOL, (
            s,
            m,
            r["max_diff"],
        )  # loss, every gradient, every parameter after SGD
        assert r["peak_live"] == r["peak_live_in_order"], (s, m)
        if s.endswith("gpipe"):
            assert r["peak_live"] == [m] * p  # every stage holds every micro-batch
        elif s.endswith("1f1b") and "interleaved" not in s:
            assert r["peak_live"] == [min(m, p - k) for k in range(p)]
        else:  # interleaved: more than 1F1B holds (the warm-up covers v stages), at most every micro-batch of both
            assert all(min(m, p - k) <= live <= 2 * m for k, live in enumerate(r["peak_live"]))


@pytest.fixture(scope="module")
def two_stages():
    # The default command: --stage-ms 200 of simulated work per rank and batch, so at m=8 a micro-batch forward
    # is 25 ms (12.5 ms per interleaved stage), well above send/recv latency and scheduler noise.
    return run_lesson("09_model_parallel", nproc=2, args=DEV, timeout_s=720).check()


@pytest.mark.timeout(800)
def test_two_stages_equal_unsplit(two_stages):
    res = two_stages.results
    assert res["pp_ranks"] == [0, 1]  # Grid(info, pp=2).ranks_in("pp")
    _check_rows(rows_of(res), 2, [1, 2, 4, 8])
    claims = assert_claims(res, EQUAL | ALWAYS | BUBBLE | ACCUMULATION)
    assert claims["schedule_steps_do_not_accumulate_2g"]["value"] == pytest.approx(
        0.5, abs=1e-5
    )  # 2 - 3/2
    equal_lines = [layer for layer in two_stages.lines() if "= unsplit" in layer]
    assert len(equal_lines) == 5 and all("holds]" in layer for layer in equal_lines)
    assert_lines_fit(two_stages)


@pytest.mark.timeout(800)
def test_two_stages_bubble_near_theory(two_stages):
    res, rows = two_stages.results, rows_of(two_stages.results)
    for (s, m), r in rows.items():
        bubble = res[f"bubble_{s}_m{m}"]
        assert abs(bubble - r["theory_bubble"]) < 0.1, (s, m, bubble)
        assert bubble > r["theory_bubble"] - 0.03  # above theory: messages only add idle time
    assert rows["torch-interleaved-1f1b", 4]["theory_bubble"] == pytest.approx(
        1 / 9
    )  # (p-1)/(v*m+p-1)
    assert res["bubble_torch-interleaved-1f1b_m2"] < res["bubble_torch-1f1b_m2"]


@pytest.mark.timeout(800)
def test_two_stages_memory(two_stages):
    # GPipe's stage 0 holds the whole batch's activations for any m; 1F1B's holds 2 of m micro-batches
    by = {k: r["peak_activation_bytes"] for k, r in rows_of(two_stages.results).items()}
    assert by[("gpipe", 8)][0] == by[("gpipe", 1)][0] > 0
    assert by[("1f1b", 8)][0] == pytest.approx(by[("gpipe", 8)][0] * 2 / 8)
    assert by[("1f1b", 8)][1] == pytest.approx(by[("gpipe", 8)][1] / 8)


@pytest.mark.timeout(800)
def test_two_stages_naive_split_and_uneven(two_stages):
    # the naive split: under torchrun it stays on this rank's device (simulated), and computes the unsplit
    # model's numbers. (Its stages run one after the other by construction; the idle fraction illustrates that.)
    res = two_stages.results
    assert res["naive"]["devices"] == ["cpu", "cpu"]
    assert res["claims"]["naive_split_equals_unsplit"]["value"] < TOL
    assert res["claims"]["naive_split_idle_fraction"]["value"] < 0.1  # |idle - 0.5|
    assert res["uneven_sizes"] == [3, 3, 3, 1]
    assert res["claims"]["uneven_weighted_loss_equals_unsplit"]["value"] < TOL
    assert (
        "skipped: torch.distributed.pipelining needs m to divide" not in two_stages.stdout
    )  # 32 into 1..8


@pytest.mark.timeout(800)
def test_four_stages_equal_unsplit():
    run = run_lesson(
        "09_model_parallel", nproc=4, args=["--stage-ms", "0", "--batch-size", "16"], timeout_s=720
    ).check()
    assert run.results["pp_ranks"] == [0, 1, 2, 3]
    _check_rows(rows_of(run.results), 4, [1, 2, 4, 8])
    claims = assert_claims(run.results, EQUAL | ALWAYS | ACCUMULATION)
    assert not BUBBLE & set(claims)  # no timing claims without the simulated kernel


@pytest.mark.timeout(400)
def test_plain_python_one_stage():
    run = run_lesson(
        "09_model_parallel",
        nproc=None,
        args=["--stage-ms", "0", "--microbatches", "1,4"],
        timeout_s=240,
    ).check()
    assert_lines_fit(run)
    rows = rows_of(run.results)
    assert set(rows) == {("gpipe", 1), ("gpipe", 4), ("1f1b", 1), ("1f1b", 4)}
    assert all(r["max_diff"] < TOL for r in rows.values())
    assert "skipped: needs a process group" in run.stdout
    claims = assert_claims(run.results, {"gpipe_equals_unsplit", "1f1b_equals_unsplit"} | ALWAYS)
    assert not ACCUMULATION & set(claims)  # torch's schedules need a process group


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--stages", "3"], "3 pipeline stages need 3 processes"),
        (["--microbatches", "64"], "64 micro-batches need at least 64 samples"),
        (["--split-points", "20"], "split point 20 is outside the model"),
    ],
)
def test_bad_input_fails_on_every_rank(args, message):
    run = run_lesson("09_model_parallel", nproc=2, args=args, timeout_s=240)
    assert_fails_on_every_rank(run, 2, message)


@pytest.mark.timeout(400)
def test_benchmark_runs():
    """benchmarks/pipeline_bubble.py (the real-compute speed-up that left the lesson) still runs: one process, one
    stage (its send/recv path is the lesson's executor, tested above); timings only, as [perf] lines."""
    from common.run.processes import REPO_ROOT

    run = run_lesson(
        REPO_ROOT / "benchmarks" / "pipeline_bubble.py",
        nproc=None,
        args=["--width", "64", "--batch", "16", "--steps", "1"],
        timeout_s=240,
    ).check()
    assert run.results["config"]["stages"] == 1
    assert (
        run.results["step_ms_m1"] > 0
        and run.results["step_ms_m4"] > 0
        and run.results["speedup_m4"] > 0
    )
    assert all(
        layer.startswith("[perf]") for layer in run.stdout.splitlines()[1:]
    )  # every timing is a [perf] line
