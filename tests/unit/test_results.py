"""Claims recorded once (common/harness/results.py): printed on rank 0 and recorded under the same name."""

from __future__ import annotations

import json

import pytest
import torch

from common.harness.env import DistInfo
from common.harness.results import Report, holds
from tests._lessons import assert_claims


@pytest.mark.parametrize(
    "value, relation, bound, expected",
    [
        (1e-9, "<=", 1e-5, True),
        (2e-5, "<=", 1e-5, False),
        (0.9, ">=", 0.85, True),
        (0.8, ">=", 0.85, False),
        (0.0, "==", 0.0, True),
        (1e-12, "==", 0.0, False),
        (float("nan"), "<=", 1.0, False),
        (3, "==", 3, True),
    ],
)
def test_holds(value, relation, bound, expected):
    assert holds(value, relation, bound) is expected


def test_unknown_relation_is_refused():
    with pytest.raises(ValueError, match="relation"):
        holds(1.0, "<", 2.0)


def test_claim_is_printed_with_its_bound_and_recorded_under_its_name(tmp_path, capsys):
    report = Report(DistInfo())
    assert report.claim(
        "ddp_equals_one_process", torch.tensor(3e-9), "<=", 1e-5, "max |diff| = {value:.1e}"
    )
    assert not report.claim("too_slow", 0.5, ">=", 0.85, "efficiency {value:.2f}", perf=True)
    report.value("final_test_accuracy", 0.9833, "final test_acc {value:.4f}")
    report.perf("samples_per_s", 1234.5, "{value:.0f} samples/s")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "max |diff| = 3.0e-09  [claim <= 1e-05: holds]"
    assert out[1] == "[perf] efficiency 0.50  [claim >= 0.85: DOES NOT HOLD]"
    assert out[2:] == ["final test_acc 0.9833", "[perf] 1234 samples/s"]
    report.write(tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["claims"]["ddp_equals_one_process"] == {
        "value": pytest.approx(3e-9),
        "bound": 1e-5,
        "relation": "<=",
        "holds": True,
        "text": "max |diff| = 3.0e-09",
    }
    assert r["final_test_accuracy"] == 0.9833 and r["samples_per_s"] == 1234.5
    with pytest.raises(AssertionError, match="too_slow"):
        assert_claims(r, {"ddp_equals_one_process"})


def test_a_claim_is_recorded_once():
    report = Report()
    report.claim("x", 1, "==", 1, "x")
    with pytest.raises(ValueError, match="twice"):
        report.claim("x", 1, "==", 1, "x")


def test_only_rank0_prints_and_writes(tmp_path, capsys):
    report = Report(DistInfo(rank=1, world_size=2, backend="gloo"))
    report.claim("x", 1, "==", 1, "x")
    report.write(tmp_path / "r.json")
    assert capsys.readouterr().out == "" and not (tmp_path / "r.json").exists()
    assert report.results["claims"]["x"]["holds"]


def test_assert_claims_names_the_missing_claim():
    with pytest.raises(AssertionError, match="not recorded: \\['b'\\]"):
        assert_claims(
            {"claims": {"a": {"value": 1, "bound": 1, "relation": "==", "holds": True}}}, {"a", "b"}
        )


@pytest.fixture
def exit_status():
    """common.harness.process_exit's pending exit status, restored after the test (finish sets it)."""
    from common.harness import process_exit

    yield process_exit
    process_exit.set_exit_status(0)


def test_finish_writes_says_all_checks_hold_and_leaves_status_0(tmp_path, capsys, exit_status):
    report = Report(DistInfo())
    report.claim("a", 1e-9, "<=", 1e-5, "a {value}")
    report.claim("b", 3, "==", 3, "b {value}")
    assert report.finish(tmp_path / "r.json") == 0
    assert capsys.readouterr().out.splitlines()[-1] == "2 checks hold"
    assert json.loads((tmp_path / "r.json").read_text())["claims"]["b"]["holds"]
    assert exit_status.exit_status() == 0


def test_finish_names_the_claims_that_do_not_hold_and_sets_status_1(tmp_path, capsys, exit_status):
    report = Report(DistInfo())
    report.claim("equals_one_process", float("nan"), "<=", 1e-5, "diff {value}")
    report.claim("fine", 0.0, "<=", 1e-5, "diff {value}")
    report.claim("loss_falls", 0.9, "<=", 0.8, "ratio {value}")
    assert report.failing() == ["equals_one_process", "loss_falls"]
    assert report.finish(tmp_path / "r.json") == 1
    assert (
        capsys.readouterr().out.splitlines()[-1]
        == "2 of 3 checks do not hold: equals_one_process, loss_falls"
    )
    assert exit_status.exit_status() == 1
    assert not json.loads((tmp_path / "r.json").read_text())["claims"]["loss_falls"]["holds"]


def test_finish_on_another_rank_prints_nothing_but_sets_the_status(tmp_path, capsys, exit_status):
    report = Report(
        DistInfo(rank=1, world_size=2)
    )  # no process group: no collective, this rank's own claims
    report.claim("x", 2, "==", 1, "x")
    assert report.finish(tmp_path / "r.json") == 1
    assert capsys.readouterr().out == "" and not (tmp_path / "r.json").exists()


def test_run_main_exits_1_after_finish_finds_a_claim_that_does_not_hold(tmp_path):
    import subprocess
    import sys

    code = (
        "from common.harness.results import Report\nfrom common.harness.session import run_main\n"
        "def main():\n    r = Report()\n    r.claim('equal', float('nan'), '<=', 1e-5, 'd {value}')\n"
        "    r.finish(None)\n    print('main returned')\nrun_main(main)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines()[-2:] == ["1 of 1 checks do not hold: equal", "main returned"]


@pytest.mark.timeout(60)
def test_rank0s_claims_decide_the_status_of_every_rank(tmp_path):
    from tests._10_workers import finish_statuses
    from tests._workers import run_world

    assert run_world(finish_statuses, 2, tmp_path) == [{"rank0_holds": 0, "rank0_fails": 1}] * 2


def test_a_whole_bound_prints_whole_and_a_small_one_short(capsys):
    report = Report()
    report.claim("bytes_exact", 2182180, "==", 2182180, "bytes {value}")
    report.claim("small", 3e-9, "<=", 1e-5, "diff {value:.1e}")
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "bytes 2182180  [claim == 2182180: holds]",
        "diff 3.0e-09  [claim <= 1e-05: holds]",
    ]
