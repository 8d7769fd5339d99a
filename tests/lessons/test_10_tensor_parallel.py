"""Lesson 10: tensor parallelism at tp = 4 (and as one process): split = unsplit, one all-reduce forward and one
backward per block of B x S x H x 4 bytes, 1/tp of the weights, sequence parallelism, training; bad input."""
from __future__ import annotations

import pytest

from common.launch import run_lesson
from tests._lessons import assert_claims, assert_fails_on_every_rank

LESSON = "10_tensor_parallel"
B, S, H = 32, 8, 32  # the lesson's defaults: --batch-size, tokens per image, --hidden
ACT_BYTES = B * S * H * 4
HAND = {f"hand_{block}_{c}" for block in ("mlp", "attention") for c in
        ("equals_unsplit", "allreduces_forward", "allreduces_backward", "allreduce_bytes", "in_tp_group",
         "weight_bytes_fraction")}
TRAIN = {"training_follows_unsplit", "training_params_equal_unsplit", "training_loss_falls"}
DTENSOR = {"dtensor_mlp_equals_unsplit", "dtensor_mlp_collectives_as_by_hand", "dtensor_attention_equals_unsplit",
           "sequence_parallel_equals_unsplit", "sequence_parallel_collectives", "sequence_parallel_same_bytes",
           "sequence_parallel_saves_less"}


@pytest.fixture(scope="module")
def tp4():
    return run_lesson(LESSON, nproc=4, timeout_s=240).check().results


@pytest.fixture(scope="module")
def one_process():
    return run_lesson(LESSON, nproc=None, timeout_s=120).check().results


@pytest.mark.timeout(300)
def test_split_equals_unsplit_with_one_allreduce_each_way_at_tp4(tp4):
    claims = assert_claims(tp4, HAND | DTENSOR | TRAIN)
    for block in ("mlp", "attention"):
        assert claims[f"hand_{block}_allreduces_forward"]["value"] == 1
        assert claims[f"hand_{block}_allreduces_backward"]["value"] == 1
        assert claims[f"hand_{block}_allreduce_bytes"]["value"] == 2 * ACT_BYTES
        assert claims[f"hand_{block}_weight_bytes_fraction"]["value"] == 0.25
        assert claims[f"hand_{block}_equals_unsplit"]["value"] <= 1e-5
    assert tp4["grid"] == ["tp=4 = 4 ranks", "tp groups: [0, 1, 2, 3]"]


@pytest.mark.timeout(300)
def test_dtensor_attention_sums_q_k_v_input_gradients_separately(tp4):
    assert tp4["dtensor_attention_backward_allreduces"] == 3  # one per ColwiseParallel projection; by hand 1
    assert tp4["claims"]["sequence_parallel_saves_less"]["value"] > 0


@pytest.mark.timeout(300)
def test_training_follows_the_unsplit_run_and_learns(tp4):
    losses = tp4["losses"]
    assert len(losses["split"]) == len(losses["unsplit"]) == 40
    assert max(abs(a - b) for a, b in zip(losses["split"], losses["unsplit"])) <= 1e-5
    assert tp4["test_accuracy"] > 0.2  # 10 classes: chance is 0.1


@pytest.mark.timeout(150)
def test_one_process_degenerates_to_the_unsplit_model(one_process):
    claims = assert_claims(one_process, HAND | TRAIN)
    assert not DTENSOR & set(claims)  # DTensor needs tp > 1
    assert claims["hand_mlp_allreduces_forward"]["value"] == 0
    assert claims["hand_mlp_weight_bytes_fraction"]["value"] == 1
    assert claims["training_follows_unsplit"]["value"] == 0.0


@pytest.mark.timeout(120)
def test_a_tp_degree_that_does_not_divide_the_heads_fails_on_every_rank():
    run = run_lesson(LESSON, nproc=2, args=["--heads", "3"], timeout_s=90)
    assert_fails_on_every_rank(run, 2, "must divide the head count 3")
