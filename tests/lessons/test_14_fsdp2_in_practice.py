"""Lesson 14: FSDP2's knobs on 4 gloo ranks, each a claim: HSDP equals one process with the bytes predicted in
the groups the mesh names; reduce_dtype halves or keeps the reduce-scatter bytes, and only None rounds the
reduction (against the same local gradients averaged in float64); reshard_after_forward True, False and 2
gather and hold what they should; a meta-built model initialised or loaded from rank 0 (one tensor per
broadcast) equals eager, buffers included; accumulation with set_requires_gradient_sync equals one process with k times fewer
reduce-scatters; prefetching all-gathers the next block in the order FSDP2's source says and holds one more
block; clipping is one process's and Adam's state sharded; bad input fails on every rank. One default launch (the notebook's and the minimal test's)."""

from __future__ import annotations

import pytest

from common.run.launch import run_lesson
from tests._lessons import DEV, assert_claims, assert_fails_on_every_rank, assert_lines_fit

LESSON = "14_fsdp2_in_practice"
AG, RS = "all_gather_single", "reduce_scatter_single"
HSDP = {
    "hsdp_equals_one_process",
    "hsdp_all_gather_single_bytes",
    "hsdp_reduce_scatter_single_bytes",
    "hsdp_all_reduce_bytes",
    "hsdp_groups_as_mesh",
    "hsdp_parameter_bytes",
    "hsdp_memory_between",
}
PREFETCH = {
    "prefetch_implicit_backward",
    "prefetch_none_backward",
    "prefetch_explicit_backward_as_implicit",
    "prefetch_explicit_forward",
    "prefetch_implicit_peak",
    "prefetch_explicit_peak",
    "prefetch_no_overlap_here",
}
MIXED = {
    "mp_reduce_default_halves_bytes",
    "mp_reduce_fp32_bytes",
    "mp_reduce_fp32_exact",
    "mp_reduce_low_rounds",
}
RESHARD = {
    f"{name}_{what}"
    for name in ("reshard_true", "reshard_false", "reshard_int")
    for what in ("all_gathers", "small_groups", "held_bytes")
}
META = {
    "meta_init_equals_eager",
    "meta_init_one_layer_at_a_time",
    "broadcast_one_tensor_at_a_time",
    "broadcast_loads_persistent_buffer",
    "broadcast_load_equals_eager",
}
CLIPPING = {"clip_norm_equals_one_process", "clipped_grads_equal", "adam_state_sharded"}
ACCUMULATION = {
    "accumulation_equals_one_process",
    "accumulation_fewer_reduce_scatters",
    "accumulation_held_sync_false",
    "accumulation_held_sync_true",
}


@pytest.fixture(scope="module")
def default4():
    """The default launch: 4 ranks, HSDP 2 x 2 (the command notebook 14 runs)."""
    return run_lesson(LESSON, nproc=4, args=DEV, timeout_s=300).check()


@pytest.mark.timeout(400)
def test_every_knob_is_a_claim_that_holds_on_4_ranks(default4):
    claims = assert_claims(
        default4.results, HSDP | PREFETCH | MIXED | RESHARD | META | ACCUMULATION | CLIPPING
    )
    assert len(claims) == 39
    assert_lines_fit(default4)
    assert claims["hsdp_equals_one_process"]["value"] <= 1e-6  # float32 rounding: 1.5e-8 measured
    assert claims["meta_init_equals_eager"]["value"] == 0.0  # the same numbers, bit for bit


@pytest.mark.timeout(400)
def test_the_mesh_names_say_which_dim_shards_and_which_replicates(default4):
    out, r = default4.stdout, default4.results
    assert "dp_replicate groups: [0, 2] [1, 3]" in out and "dp_shard groups: [0, 1] [2, 3]" in out
    assert r["mesh"] == {"dp_replicate": 2, "dp_shard": 2}
    held = r["parameter_bytes"]  # DDP all, HSDP 1/2, FSDP 1/4 (rows of the head padded 10 -> 12)
    assert held["DDP"] == 4 * r["n_params"] == 26536
    assert (held["HSDP"], held["FSDP"]) == (13268, 6700)


@pytest.mark.timeout(400)
def test_prefetch_gathers_the_next_block_ahead_and_holds_one_more(default4):
    claims, logs = default4.results["claims"], default4.results["prefetch_logs"]
    root, block = 9904, 8448  # the root (stem, head rows 10 -> 12) and a block, rows padded to 4
    assert claims["prefetch_implicit_peak"]["value"] == root + block
    assert claims["prefetch_explicit_peak"]["value"] == root + 2 * block == 26800
    ops = [op for op, _ in logs["explicit"]]  # block 1 gathered before block 0's first layer runs
    assert ops.index("forward blocks.0.0") == 4 and ops[:2] == ["all_gather_single"] * 2
    backward = [tuple(e) for e in logs["none"][logs["none"].index(["backward", 0]) :]]
    assert backward[1:4] == [(AG, block), (RS, block), (AG, block)]  # none: gather, reduce, gather


@pytest.mark.timeout(400)
def test_reshard_and_accumulation_hold_what_the_shapes_say(default4):
    claims = default4.results["claims"]
    full = claims["reshard_false_held_bytes"]["value"]  # every unit gathered, rows padded to 4
    assert full == 26800 and claims["reshard_true_held_bytes"]["value"] == full // 4
    assert claims["reshard_int_held_bytes"]["value"] == full // 2
    assert (
        claims["reshard_false_all_gathers"]["value"] * 2
        == claims["reshard_true_all_gathers"]["value"]
    )
    # sync off keeps every gradient unsharded: 4x what a synced micro-step leaves (+ the head's padding)
    assert claims["accumulation_held_sync_false"]["value"] == 26536
    assert claims["accumulation_held_sync_true"]["value"] == 6700
    # Adam, the most a rank holds: exp_avg and exp_avg_sq of a padded quarter (6700 bytes each), + 12 four-byte
    # steps; the last rank's quarter is short (the head's rows 3, 3, 3, 1 of 10, state unpadded)
    assert claims["adam_state_sharded"]["value"] == 2 * 6700 + 4 * 12
    assert default4.results["adam_state_least"] == 12920
    rows = default4.results[
        "mixed_precision"
    ]  # vs the same bf16 local gradients averaged in float64
    assert rows["reduce_fp32"]["error"] <= 1e-6 < 1e-4 <= rows["reduce_low"]["error"]
    assert claims["broadcast_one_tensor_at_a_time"]["value"] == 4 * 32 * 64  # the stem's weight
    assert "CPUOffloadPolicy(pin_memory=False) on cpu: ran, gradients on cpu" in default4.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--replicate", "3"], "--replicate 3 does not divide the world of 2 ranks"),
        (["--param-dtype", "fp8"], "unknown --param-dtype 'fp8': choose bf16 or fp16"),
        (["--depth", "1"], "--depth, --micro-steps: >= 2"),
    ],
)
def test_bad_input_fails_on_every_rank(args, message):
    run = run_lesson(LESSON, nproc=2, args=[*DEV, *args], timeout_s=200)
    assert_fails_on_every_rank(run, 2, message)
