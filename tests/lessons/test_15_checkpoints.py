"""Lesson 15: DCP checkpoints of FSDP2 and DDP state. On 4 ranks every rank writes its own chunks and DDP's
replicated state is written once; ranks 0-1 load the 4-rank checkpoints (0.0) and continue as the 4 ranks did;
full_model.pt loads in a plain process; async_save's checkpoint is the state at the call; the marker comes
last and a save killed before it leaves the last complete checkpoint. A separate launch loads what another
world size saved; a NaN in what one rank loads fails the load's claims; bad input fails on every rank."""

from __future__ import annotations

import shutil

import pytest
import torch

from common.checkpoint.sharded import FULL_MODEL, MARKER
from common.models import ResidualMLP
from common.run.launch import run_lesson
from tests._15_workers import launch_with_nan_on_rank1
from tests._lessons import DEV, assert_claims, assert_fails_on_every_rank, assert_lines_fit

LESSON = "15_checkpoints"
LOAD = {
    "sharded_load_equals_saved",
    "continued_training_matches_saving_world",
    "params_equal_at_the_switch",
    "ddp_continued_training_matches_saving_world",
    "full_state_dict_same_outputs",
}
SAVE = {
    "each_rank_writes_its_shard",
    "ddp_state_written_once",
    "async_save_is_the_state_at_the_call",
    "marker_written_last",
    "unfinished_save_leaves_the_last_checkpoint",
}


@pytest.fixture(scope="module")
def default4():
    """4 ranks at the defaults (the command notebook 15 runs: one launch serves both)."""
    return run_lesson(LESSON, nproc=4, args=DEV, timeout_s=300).check()


@pytest.fixture(scope="module")
def saved2(tmp_path_factory):
    """2 ranks, the checkpoints kept under ROOT (rank 0 alone loads them inside the run)."""
    root = tmp_path_factory.mktemp("ckpt15")
    return root, run_lesson(
        LESSON, nproc=2, args=[*DEV, "--save", str(root)], timeout_s=300
    ).check()


@pytest.mark.timeout(600)
def test_four_ranks_save_reshard_to_two_and_continue(default4):
    r = default4.results
    claims = assert_claims(r, LOAD | SAVE)
    assert r["world_size"] == 4
    assert (
        "2. FSDP2 checkpoint saved by 4 ranks, loaded by 2: max |difference| 0.0" in default4.stdout
    )
    assert claims["sharded_load_equals_saved"]["value"] == 0.0
    assert claims["params_equal_at_the_switch"]["value"] == 0.0
    assert claims["async_save_is_the_state_at_the_call"]["value"] == 0.0
    assert claims["continued_training_matches_saving_world"]["value"] <= 1e-4
    # which rank wrote which bytes: 4 files, rank 3's smaller (33 rows: 9, 9, 9, 6)
    per_file = r["fsdp2_bytes_per_file"]
    assert len(per_file) == 4 and per_file[3] < per_file[0]
    # which rank read them back: every saved byte of a sharded tensor read by exactly one of the 2 ranks
    assert len(r["read_plan"]) == 2
    assert [sum(col) for col in zip(*r["read_plan"])] == [
        sum(c["bytes"] for c in r["fsdp2_chunks"] if c["rank"] == k and c["sizes"])
        for k in range(4)
    ]
    assert_lines_fit(default4)


@pytest.mark.timeout(600)
def test_the_saved_root_is_marked_last_and_a_plain_process_loads_it(saved2):
    root, run = saved2
    assert_claims(run.results, LOAD | SAVE)
    folder = root / "fsdp2" / "step_000003"
    files = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert {MARKER, ".metadata", FULL_MODEL, "after_more_steps.pt"} <= set(files)
    assert sum(n.endswith(".distcp") for n in files) == 2  # one file per saving rank
    assert files[MARKER] == max(files.values())
    assert not (root / "fsdp2" / "step_000005" / MARKER).exists()  # the killed save: no marker
    plain = ResidualMLP(33, 2)  # this test is a plain python process: no process group
    plain.load_state_dict(torch.load(folder / FULL_MODEL, weights_only=True), strict=True)
    assert_lines_fit(run)


@pytest.mark.timeout(600)
def test_a_separate_launch_loads_what_another_world_size_saved(saved2):
    root, _ = saved2
    run = run_lesson(LESSON, nproc=4, args=[*DEV, "--load", str(root)], timeout_s=300).check()
    claims = assert_claims(run.results, LOAD)
    assert not SAVE & set(claims)
    assert "FSDP2 checkpoint saved by 2 ranks, loaded by 4: max |difference| 0.0" in run.stdout
    assert claims["params_equal_at_the_switch"]["value"] == 0.0


@pytest.mark.timeout(600)
def test_a_nan_in_what_rank_1_loads_fails_the_load_claims(saved2):
    root, _ = saved2
    run = launch_with_nan_on_rank1([*DEV, "--load", str(root)])
    assert run.returncode == 1, run.stdout
    failing = {k for k, c in run.results["claims"].items() if not c["holds"]}
    assert {"sharded_load_equals_saved", "params_equal_at_the_switch"} <= failing


@pytest.mark.timeout(600)
def test_an_unfinished_checkpoint_or_a_world_that_cannot_continue_fails_on_every_rank(
    saved2, tmp_path
):
    root, _ = saved2
    partial = tmp_path / "partial"
    shutil.copytree(root, partial)
    (partial / "fsdp2" / "step_000003" / MARKER).unlink()  # as if the save had died before it
    run = run_lesson(LESSON, nproc=2, args=[*DEV, "--load", str(partial)], timeout_s=120)
    assert_fails_on_every_rank(run, 2, "holds no complete checkpoint")
    run = run_lesson(LESSON, nproc=3, args=[*DEV, "--load", str(root)], timeout_s=120)
    assert_fails_on_every_rank(run, 3, "3 ranks cannot continue it")
