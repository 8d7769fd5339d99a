"""Lesson 22: tensor-parallel decoding at tp = 2 (the default launch the notebook and the minimal test share)
and tp = 4 (small): the cache equals recomputing the prefix, tp equals one process, the cache is 1/tp a rank,
two all-reduces per layer per token with their bytes, prefill vs decode, the planner's KV bytes, batch
composition; a head count tp does not divide is refused on every rank."""

from __future__ import annotations

import pytest

from common.run.launch import run_lesson
from tests._lessons import assert_claims, assert_fails_on_every_rank, assert_lines_fit

LESSON = "22_parallel_inference"
SMALL = ["--prompt-len", "8", "--new-tokens", "4"]
ONE_PROCESS = {
    "cache_tokens_equal_recompute",
    "cache_logits_within_bound",
    "cache_flops_equal_formula",
    "recompute_flops_equal_formula",
    "prefill_intensity_is_P_times_decode",
    "planner_kv_bytes_equal_measured",
    "llama_batch_at_2048",
    "llama_batch_at_8192",
    "batched_tokens_equal_alone",
    "batched_logits_within_bound",
}
TP = {
    "tp_tokens_equal_one_process",
    "tp_logits_within_bound",
    "cache_heads_match_one_process",
    "cache_bytes_are_one_over_tp",
    "two_all_reduces_per_layer_per_token",
    "all_reduce_bytes_equal_prediction",
    "prefill_sends_prompt_times_decode",
}


@pytest.fixture(scope="module")
def tp2_run():
    return run_lesson(LESSON, nproc=2, timeout_s=300).check()


@pytest.fixture(scope="module")
def tp4_run():
    return run_lesson(LESSON, nproc=4, args=SMALL, timeout_s=400).check()


@pytest.mark.timeout(360)
def test_tp2_decodes_the_tokens_of_one_process_with_half_the_cache_a_rank(tp2_run):
    r = tp2_run.results
    claims = assert_claims(r, ONE_PROCESS | TP)
    assert r["cache_heads"] == [[0, 1], [2, 3]]  # found from the filled caches
    assert claims["cache_heads_match_one_process"]["value"] <= 1e-5
    assert r["cache_bytes"] == [16384, 16384]  # 2 x 2 layers x 2 heads x 8 x 32 x 2 x 4
    assert claims["two_all_reduces_per_layer_per_token"]["value"] == 2
    phases = r["phases"]
    assert [op for op, _ in phases["decode"]["log"]] == ["all_reduce"] * 4  # 2 layers x 2
    assert phases["prefill"]["bytes"] == 16 * phases["decode"]["bytes"]
    assert phases["decode"]["intensity"] < phases["prefill"]["intensity"]
    assert r["flops_per_token"]["recompute"] > 10 * r["flops_per_token"]["cache"]
    assert 0 <= r["batch_logit_difference"] <= 1e-5
    assert (
        r["smallest_top2_margin"] > 100 * r["batch_logit_difference"]
    )  # why the tokens are stable
    assert_lines_fit(tp2_run)


@pytest.mark.timeout(460)
def test_tp4_splits_one_head_a_rank_and_keeps_the_tokens(tp4_run):
    r = tp4_run.results
    claims = assert_claims(r, ONE_PROCESS | TP)
    assert r["cache_heads"] == [[0], [1], [2], [3]]
    assert len(set(r["cache_bytes"])) == 1
    assert claims["all_reduce_bytes_equal_prediction"]["value"] == 0
    assert_lines_fit(tp4_run)


@pytest.mark.timeout(200)
def test_a_head_count_tp_does_not_divide_is_refused_on_every_rank():
    run = run_lesson(LESSON, nproc=2, args=["--heads", "1"], timeout_s=150)
    assert_fails_on_every_rank(run, 2, "must divide the head count 1")
