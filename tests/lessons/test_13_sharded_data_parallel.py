"""Lesson 13: ZeRO stages by hand equal DDP on 4 ranks (6973 parameters: 4 does not divide the stem's 2145),
each rank holds 1/N where the stage says and the activations DDP holds (measured per row), bytes as the formulas
(stage 3: 1.5x DDP), PyTorch's versions agree; bad input fails on every rank. (Saving that sharded state and
loading it on another world size: tests/lessons/test_15_checkpoints.py.)"""

from __future__ import annotations

import pytest

from common.run.launch import run_lesson
from tests._lessons import assert_claims, assert_fails_on_every_rank, assert_lines_fit

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


@pytest.fixture(scope="module")
def saved4():
    """4 ranks, every section (the command notebook 13 runs: one launch serves both)."""
    return run_lesson(LESSON, nproc=4, timeout_s=480).check()


@pytest.fixture(scope="module")
def one_process():
    return run_lesson(LESSON, nproc=None, timeout_s=240).check()


@pytest.mark.timeout(600)
def test_every_stage_equals_ddp_on_4_ranks_with_a_count_4_does_not_divide(saved4):
    r = saved4.results
    claims = assert_claims(
        r, STAGES | SHARES | RATIOS | PYTORCH | {"ddp_bytes_as_formula", "activations_as_ddp"}
    )
    # 6973 parameters: padding on every world size; 2145 -> the next multiple of 4
    assert r["world_size"] == 4 and r["n_params"] % 4 and r["n_params"] % 2
    assert r["padded_units"]["stem"] == 2148 and r["padded_units"]["head"] == 340
    assert "padding: stem +3\n" in saved4.stdout  # the sentence follows the sizes: only the stem
    for s in (1, 2, 3):  # ||stage - DDP|| / ||DDP's change||: float32 rounding, 3.4e-7 measured
        assert claims[f"stage{s}_equals_ddp"]["value"] <= 1e-4
    assert r["stage3_calls"] == {"all_gather_single": 40, "reduce_scatter_single": 20}
    assert_lines_fit(saved4)


@pytest.mark.timeout(600)
def test_each_stage_holds_a_quarter_where_it_shards_on_4_ranks(saved4):
    table = saved4.results["memory_table"]
    ddp = table["DDP"]
    assert set(table) == {"DDP", "stage 1", "stage 2", "stage 3", "FSDP2"}
    for s in (1, 2, 3):
        row = table[f"stage {s}"]
        assert row["optimizer_state"] / ddp["optimizer_state"] == pytest.approx(0.25, abs=0.01)
        assert row["activations"] == ddp["activations"] > 0  # measured per row: left alone
        assert (row["gradients"] / ddp["gradients"] == pytest.approx(0.25, abs=0.01)) == (s >= 2)
        assert (row["parameters"] / ddp["parameters"] == pytest.approx(0.25, abs=0.01)) == (s == 3)
    # rows padded 33 -> 36
    assert table["FSDP2"]["parameters"] / ddp["parameters"] == pytest.approx(0.25, abs=0.03)
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


@pytest.mark.timeout(300)
def test_one_process_degenerates_to_plain_adam(one_process):
    r = one_process.results
    claims = assert_claims(r, STAGES | SHARES | {"ddp_bytes_as_formula", "activations_as_ddp"})
    assert not (PYTORCH | RATIOS) & set(claims)  # FSDP2, ZeroRedundancyOptimizer need a group
    assert all(claims[f"stage{s}_equals_ddp"]["value"] == 0.0 for s in (1, 2, 3))
    assert all(row["moved"] == 0 for row in r["memory_table"].values())
    assert_lines_fit(one_process)


@pytest.mark.timeout(240)
def test_a_stage_that_does_not_exist_fails_on_every_rank():
    run = run_lesson(LESSON, nproc=2, args=["--stages", "1,4"], timeout_s=180)
    assert_fails_on_every_rank(run, 2, "ZeRO has stages 1, 2 and 3")
