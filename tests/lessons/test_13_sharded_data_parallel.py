"""Lesson 13: ZeRO stages by hand equal DDP on 4 and 2 ranks (6973 parameters: 4 does not divide the stem's
2145), each rank holds 1/N where the stage says and the activations DDP holds (measured per row), bytes as the
formulas (stage 3: 1.5x DDP), PyTorch's versions agree, a sharded checkpoint saved by 4 ranks loads on 2; bad
input fails on every rank."""

from __future__ import annotations

import shutil

import pytest

from common.run.launch import run_lesson
from tests._lessons import assert_claims, assert_fails_on_every_rank

LESSON = "13_sharded_data_parallel"
STAGES = {
    f"stage{s}_{c}"
    for s in (1, 2, 3)
    for c in ("equals_ddp", "padding_untouched", "bytes_as_formula")
}
SHARES = {
    "stage1_optimizer_state_share",
    "stage2_optimizer_state_share",
    "stage2_gradients_share",
    "stage3_optimizer_state_share",
    "stage3_gradients_share",
    "stage3_parameters_share",
}
RATIOS = {"stage1_gradients_not_sharded"}
PYTORCH = {
    "zero_redundancy_optimizer_equals_stage1",
    "fsdp2_equals_stage3",
    "fsdp2_bytes_as_formula",
    "fsdp2_no_reshard_bytes_as_formula",
    "bf16_really_ran",
    "bf16_moves_fewer_bytes",
    "fsdp2_activations_as_ddp",
    "fsdp2_no_reshard_keeps_parameters",
}
CHECKPOINT = {
    "sharded_load_equals_saved",
    "continued_training_matches_saving_world",
    "full_state_dict_same_outputs",
}


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt13") / "sharded"


@pytest.fixture(scope="module")
def saved4(ckpt_dir):
    """4 ranks: every section, and the checkpoint saved into ckpt_dir (then loaded back by the same 4)."""
    return run_lesson(
        LESSON, nproc=4, args=["--save-sharded", str(ckpt_dir)], timeout_s=480
    ).check()


@pytest.fixture(scope="module")
def loaded2(saved4, ckpt_dir):
    """2 ranks: every section again, and the checkpoint the 4 ranks saved, loaded by 2 (resharded)."""
    return run_lesson(
        LESSON, nproc=2, args=["--load-sharded", str(ckpt_dir)], timeout_s=360
    ).check()


@pytest.fixture(scope="module")
def one_process():
    return run_lesson(LESSON, nproc=None, timeout_s=240).check().results


@pytest.mark.timeout(600)
def test_every_stage_equals_ddp_on_4_ranks_with_a_count_4_does_not_divide(saved4):
    r = saved4.results
    claims = assert_claims(
        r, STAGES | SHARES | RATIOS | PYTORCH | {"ddp_bytes_as_formula", "activations_as_ddp"}
    )
    assert (
        r["world_size"] == 4 and r["n_params"] % 4 and r["n_params"] % 2
    )  # 6973: padding on every world size
    assert (
        r["padded_units"]["stem"] == 2148 and r["padded_units"]["head"] == 340
    )  # 2145 -> next multiple of 4
    assert (
        "padding: stem +3\n" in saved4.stdout
    )  # the sentence follows the sizes: only the stem is padded
    for s in (
        1,
        2,
        3,
    ):  # ||stage - DDP|| / ||DDP's change||: float32 rounding measured at <= 4.3e-6
        assert claims[f"stage{s}_equals_ddp"]["value"] <= 1e-4


@pytest.mark.timeout(600)
def test_each_stage_holds_a_quarter_where_it_shards_on_4_ranks(saved4):
    table = saved4.results["memory_table"]
    ddp = table["DDP"]
    assert set(table) == {"DDP", "stage 1", "stage 2", "stage 3", "FSDP2"}
    for s in (1, 2, 3):
        row = table[f"stage {s}"]
        assert row["optimizer_state"] / ddp["optimizer_state"] == pytest.approx(0.25, abs=0.01)
        assert (
            row["activations"] == ddp["activations"] > 0
        )  # measured per row: sharding leaves them alone
        assert (row["gradients"] / ddp["gradients"] == pytest.approx(0.25, abs=0.01)) == (s >= 2)
        assert (row["parameters"] / ddp["parameters"] == pytest.approx(0.25, abs=0.01)) == (s == 3)
    assert table["FSDP2"]["parameters"] / ddp["parameters"] == pytest.approx(
        0.25, abs=0.03
    )  # rows padded 33 -> 36
    assert table["FSDP2"]["activations"] == ddp["activations"]
    # reshard_after_forward=False keeps the gathered weights autograd saved: 4 block Linears (36 x 33 rows on
    # 4 ranks) and the head's (12 x 33); not the stem's, whose input needs no gradient
    kept = saved4.results["claims"]["fsdp2_no_reshard_keeps_parameters"]["value"]
    assert kept == 4 * (4 * 36 * 33 + 12 * 33)


@pytest.mark.timeout(600)
def test_stage3_and_fsdp2_move_one_and_a_half_times_ddps_bytes(saved4):
    table, claims = saved4.results["memory_table"], saved4.results["claims"]
    psi = 4 * saved4.results["n_params"]
    assert table["DDP"]["moved"] == 2 * psi * 3 / 4
    assert table["stage 3"]["moved"] / table["DDP"]["moved"] == pytest.approx(1.5, abs=0.01)
    assert table["stage 1"]["moved"] == table["stage 2"]["moved"]
    # FSDP2 pads each parameter's 33 rows to 36 on 4 ranks: more than 1.5x, as its own formula says
    assert claims["fsdp2_bytes_as_formula"]["value"] / table["DDP"]["moved"] > 1.6
    assert (
        claims["fsdp2_no_reshard_bytes_as_formula"]["value"]
        < claims["fsdp2_bytes_as_formula"]["value"]
    )


@pytest.mark.timeout(600)
def test_the_saved_checkpoint_is_marked_complete_last(saved4, ckpt_dir):
    assert_claims(saved4.results, CHECKPOINT)
    files = {p.name: p.stat().st_mtime_ns for p in ckpt_dir.iterdir()}
    assert {"COMPLETE.json", ".metadata", "full_model.pt", "after_more_steps.pt"} <= set(files)
    assert sum(n.endswith(".distcp") for n in files) == 4  # one shard file per saving rank
    assert files["COMPLETE.json"] == max(files.values())


@pytest.mark.timeout(600)
def test_a_checkpoint_saved_by_4_ranks_loads_on_2_and_training_continues(loaded2):
    r = loaded2.results
    claims = assert_claims(r, STAGES | SHARES | RATIOS | PYTORCH | CHECKPOINT)
    assert r["world_size"] == 2
    assert (
        "sharded checkpoint saved by 4 ranks, loaded by 2: max |difference| 0.0" in loaded2.stdout
    )
    assert claims["sharded_load_equals_saved"]["value"] == 0.0
    assert claims["continued_training_matches_saving_world"]["value"] <= 1e-4
    assert len(r["continued_losses"]) == 3 and all(
        0 < line < 2.4 for line in r["continued_losses"]
    )  # ln 10 = 2.30


@pytest.mark.timeout(300)
def test_one_process_degenerates_to_plain_adam(one_process):
    claims = assert_claims(
        one_process, STAGES | SHARES | {"ddp_bytes_as_formula", "activations_as_ddp"}
    )
    assert not (PYTORCH | CHECKPOINT | RATIOS) & set(
        claims
    )  # FSDP2, ZeroRedundancyOptimizer, DCP need a group
    assert all(claims[f"stage{s}_equals_ddp"]["value"] == 0.0 for s in (1, 2, 3))
    assert all(row["moved"] == 0 for row in one_process["memory_table"].values())


@pytest.mark.timeout(240)
def test_a_stage_that_does_not_exist_fails_on_every_rank():
    run = run_lesson(LESSON, nproc=2, args=["--stages", "1,4"], timeout_s=180)
    assert_fails_on_every_rank(run, 2, "ZeRO has stages 1, 2 and 3")


@pytest.mark.timeout(600)
def test_a_checkpoint_of_another_model_or_a_partial_one_fails_on_every_rank(
    saved4, ckpt_dir, tmp_path
):
    run = run_lesson(
        LESSON, nproc=2, args=["--load-sharded", str(ckpt_dir), "--width", "40"], timeout_s=180
    )
    assert_fails_on_every_rank(
        run, 2, "holds a checkpoint of another model: stem.weight is [33, 64] there"
    )
    partial = tmp_path / "partial"
    shutil.copytree(ckpt_dir, partial)
    (partial / "COMPLETE.json").unlink()  # as if the save had died before its last write
    run = run_lesson(LESSON, nproc=2, args=["--load-sharded", str(partial)], timeout_s=180)
    assert_fails_on_every_rank(run, 2, "has no COMPLETE.json: its save did not finish")
