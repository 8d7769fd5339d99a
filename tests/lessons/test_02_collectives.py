"""Lesson 02 launched as users launch it: torchrun with 2 processes (the full check), with 1, 3 and 4 processes
(ring == dist.all_reduce on uneven lengths in worlds of 1..4; ring versus server counted at n = 4), plain python,
bad input; and benchmarks/allreduce_bandwidth.py (the bandwidth sweep that moved out of the lesson).
The pure parts (schedule, chunks, simulation, link-bytes and bandwidth formulas) are in tests/unit/test_collectives.py.
"""

from __future__ import annotations

import pytest

from common.run.launch import run_lesson
from common.run.processes import REPO_ROOT
from tests._lessons import DEV, assert_claims, assert_fails_on_every_rank, assert_lines_fit

UNEVEN_LENGTHS = [
    "1",
    "2",
    "3",
    "5",
    "7",
    "1001",
]  # none divisible by 4; 1, 2, 3 are smaller than 4 ranks
DEFAULT_LENGTHS = ["1", "3", "7", "1001"]  # the lesson's default: odd, so none divides by 2
BENCHMARK = REPO_ROOT / "benchmarks" / "allreduce_bandwidth.py"
PSI_BYTES = 4096  # the lesson's PSI = 1024 float32
COLLECTIVES = {
    f"{op}_exact" for op in ("broadcast", "all_reduce", "reduce", "all_gather", "reduce_scatter")
}
ALWAYS = {
    "ranks_are_0_to_n_minus_1",
    "gloo_built",
    "ring_simulation_equals_sum",
    "step_collectives",
    "grad_same_on_every_rank",
    "grad_equals_global_batch",
    "params_same_on_every_rank",
    "params_equal_global_batch",
    *(f"server_over_ring_formula_n{m}" for m in (2, 4, 8)),
}


def expected_claims(n: int) -> set[str]:
    """The claims a torchrun launch with n processes records (a process group: every collective and the ring run)."""
    names = (
        set(ALWAYS)
        | COLLECTIVES
        | {
            "reduce_scatter_native",
            "barrier_missed_arrivals",
            "ring_equals_all_reduce_on_integers",
            "ring_close_to_all_reduce_on_floats",
            "ring_messages_per_rank",
            "ring_bytes_sent_share",
        }
    )
    if n >= 2:
        names |= {"send_recv_exact", "isend_irecv_ring_shift_exact"}
    for m in (2, 4, 8):
        if m <= n:
            names |= {f"ring_link_bytes_measured_n{m}", f"server_link_bytes_measured_n{m}"}
    return names


def launch(nproc, args=(), timeout_s=400):
    """Launch the lesson and require success (any failure, at exit included, fails the test)."""
    return run_lesson("02_collectives", nproc=nproc, args=list(args), timeout_s=timeout_s).check()


@pytest.fixture(scope="module")
def two():
    """The default run on 2 processes: without a GPU, notebook 02's command (one launch serves both)."""
    return launch(2, DEV)


@pytest.fixture(scope="module", params=[1, 3, 4])
def world(request):
    return request.param, launch(request.param, ["--lengths", *UNEVEN_LENGTHS])


def _check_ring(res: dict, n: int, lengths=UNEVEN_LENGTHS) -> None:
    claims = res["claims"]
    assert [row["length"] for row in res["ring_vs_all_reduce"]] == [int(x) for x in lengths]
    for row in res["ring_vs_all_reduce"]:
        assert row["int_diff"] == 0.0, row  # integer-valued data: bit for bit
        assert row["float_diff"] < 1e-4, row  # float32 sums of n ~N(0,1) values, other order
    assert claims["ring_messages_per_rank"]["value"] == 2 * (n - 1)
    assert claims["ring_bytes_sent_share"]["value"] == pytest.approx(2 * (n - 1) / n)


def _check_collectives(res: dict, n: int) -> None:
    claims = res["claims"]
    for name in COLLECTIVES | (
        {"send_recv_exact", "isend_irecv_ring_shift_exact"} if n >= 2 else set()
    ):
        assert claims[name]["value"] == 0.0, (name, claims[name])
    if n < 2:
        assert "send_recv_exact" not in claims
    assert claims["barrier_missed_arrivals"]["value"] == 0
    if res["backend"] == "gloo":
        assert (
            claims["reduce_scatter_native"]["value"] is True
        )  # gloo on CPU supports it in torch 2.13


def _check_no_parameter_server(res: dict, distributed: bool) -> None:
    claims = res["claims"]
    assert claims["step_collectives"]["value"] == int(distributed)  # one all_reduce, no broadcast
    assert (
        claims["grad_same_on_every_rank"]["value"] == 0.0
    )  # every rank holds the same averaged gradient
    assert (
        claims["params_same_on_every_rank"]["value"] == 0.0
    )  # and steps to identical parameters by itself
    assert (
        claims["grad_equals_global_batch"]["value"] < 1e-6
    )  # = the gradient of the global batch in one process
    assert claims["params_equal_global_batch"]["value"] < 1e-6


@pytest.mark.timeout(900)
def test_lesson_two_processes_checks_every_claim(two):
    res = two.results
    assert_claims(res, expected_claims(2))
    assert res["world_size"] == 2 and res["distributed"] is True
    assert [(f["rank"], f["local_rank"], f["world_size"]) for f in res["ranks"]] == [
        (0, 0, 2),
        (1, 1, 2),
    ]
    assert res["backends_built"]["gloo"] is True
    _check_collectives(res, 2)
    _check_ring(res, 2, DEFAULT_LENGTHS)
    _check_no_parameter_server(res, True)
    # ring versus server, in + out on the busiest link, counted: equal at n = 2 (the old print suggested 2x)
    assert res["claims"]["ring_link_bytes_measured_n2"]["value"] == 2 * PSI_BYTES
    assert res["claims"]["server_link_bytes_measured_n2"]["value"] == 2 * PSI_BYTES
    # deterministic summary on stdout, timings only on [perf] lines (here: the barrier waits)
    assert "DOES NOT HOLD" not in two.stdout
    assert [line for line in two.lines(perf=True) if "barrier" in line] == two.lines(perf=True)
    assert_lines_fit(two)


def test_output_runs_the_collectives_before_tabulating_them_and_defines_busbw_before_using_it(two):
    """A newcomer meets each collective (run and checked) before the table of which backend runs which, and
    algbw/busbw in words before the line that uses their ratio."""
    out = two.stdout
    assert out.index("collectives on gloo/cpu") < out.index("backend support for these collectives")
    assert out.index("busbw = algbw x") < out.index("nccl-tests' busbw / algbw")
    assert out.index("Psi = ") == out.index("Psi")  # Psi's first mention gives its size


@pytest.mark.timeout(900)
def test_ring_equals_all_reduce_in_worlds_of_1_3_4(world):
    nproc, run = world
    res = run.results
    assert res["world_size"] == nproc
    assert_claims(res, expected_claims(nproc))
    _check_collectives(res, nproc)
    _check_ring(res, nproc)
    _check_no_parameter_server(res, True)
    if (
        nproc == 4
    ):  # counted at n = 2 (a group of ranks 0, 1) and n = 4: the server's link carries n/2 x the ring's
        claims = res["claims"]
        assert claims["ring_link_bytes_measured_n4"]["value"] == 3 * PSI_BYTES  # 4(n-1)/n Psi
        assert claims["server_link_bytes_measured_n4"]["value"] == 6 * PSI_BYTES  # 2(n-1) Psi
        assert (
            claims["server_link_bytes_measured_n2"]["value"]
            == claims["ring_link_bytes_measured_n2"]["value"]
        )


@pytest.mark.timeout(360)
def test_lesson_plain_python_runs_without_a_process_group():
    run = run_lesson(
        "02_collectives", nproc=None, timeout_s=300, args=["--lengths", *UNEVEN_LENGTHS]
    ).check()
    res = run.results
    assert res["distributed"] is False and res["backend"] is None and res["world_size"] == 1
    claims = assert_claims(res, ALWAYS)
    assert not set(claims) & (
        COLLECTIVES | {"ring_messages_per_rank", "ring_link_bytes_measured_n2"}
    )
    assert claims["step_collectives"]["value"] == 0
    assert (
        claims["grad_equals_global_batch"]["value"] == 0.0
        and claims["params_equal_global_batch"]["value"] == 0.0
    )
    assert_lines_fit(run)


@pytest.mark.timeout(360)
def test_bad_input_is_one_line_on_every_rank():
    run = run_lesson("02_collectives", nproc=2, args=["--lengths", "3", "-2"], timeout_s=300)
    assert_fails_on_every_rank(run, 2, "--lengths must be positive")
    assert run.results is None


# ------------------------------------------------------------- the bandwidth sweep (benchmarks/allreduce_bandwidth.py)
@pytest.mark.timeout(480)
def test_bandwidth_benchmark_reports_algbw_and_busbw_per_size():
    sizes = ["4", "64"]
    run = run_lesson(
        BENCHMARK,
        nproc=2,
        args=["--sizes-kib", *sizes, "--iters", "20", "--warmup", "1"],
        timeout_s=400,
    ).check()
    bw = run.results["bandwidth"]
    assert [(r["op"], r["size_bytes"]) for r in bw] == [
        (op, int(s) * 1024) for s in sizes for op in ("all_reduce", "ring")
    ]
    for r in bw:
        assert 0 < r["min"] <= r["q1"] <= r["median"] <= r["q3"] <= r["max"]
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / r["median"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (2 - 1) / 2)
    assert len(run.lines(perf=True)) == len(bw)  # timings only on [perf] lines


@pytest.mark.timeout(360)
def test_benchmark_bad_input_is_one_line_on_every_rank():
    run = run_lesson(BENCHMARK, nproc=2, args=["--sizes-kib", "0"], timeout_s=300)
    assert_fails_on_every_rank(run, 2, "--sizes-kib must be positive")
    assert run.results is None
    run = run_lesson(BENCHMARK, nproc=None, args=["--sizes-kib", "64", "-4"], timeout_s=200)
    assert run.returncode == 2
    assert "error: --sizes-kib must be positive integers (KiB), got -4" in run.stderr
