"""The cost model of lesson 21 (common/planning/cost_model.py, step_time.py): published numbers, exact
small cases, FLOPs vs the counter; the planner's rows held to closed forms (lesson 21's section 6); the
meta-device recipe against a wrong one."""

import importlib
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from common.models import CausalTransformer, ResidualMLP
from common.planning.cost_model import (
    GPT,
    gpt_params,
    in_flight_micro_batches,
    residual_mlp_activations,
    sharded_fp32_bytes,
    transformer_layer_activations,
    zero_mixed_bytes,
    zero_paper_activations,
)
from common.planning.step_time import fit_alpha_beta, gpt_flops, mfu, residual_mlp_flops, ring_time
from common.planning.transformer import matmul_attention


def test_zero_paper_figure1_7_5b_on_64_gpus():
    # Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N_d = 64, K = 12: 120, 31.4, 16.6, 1.9 GB
    got = [round(zero_mixed_bytes(7.5e9, 64, s)["total"] / 1e9, 1) for s in (0, 1, 2, 3)]
    assert got == [120.0, 31.4, 16.6, 1.9]


def test_zero_paper_gpt2_1_5b():
    # section 3.1: 1.5B parameters, 3 GB of 16-bit weights, at least 24 GB with mixed-precision Adam
    assert zero_mixed_bytes(1.5e9, 1, 0)["parameters"] == 3e9
    assert zero_mixed_bytes(1.5e9, 1, 0)["total"] == 24e9
    # section 3.2: sequence 1K, batch 32: "about 60 GB" of activations (h 1600, 48 layers)
    assert round(zero_paper_activations(1600, 32, 1024, 48) / 1e9) == 60


def test_korthikanti_sequence_parallel_is_plain_over_t_and_tp_alone_keeps_10sbh():
    s, b, h, a = 2048, 1, 12288, 96
    plain = transformer_layer_activations(s, b, h, a)
    assert plain == s * b * h * (34 + 5 * a * s / h)
    assert transformer_layer_activations(s, b, h, a, tp=8, sequence_parallel=True) == plain / 8
    tp = transformer_layer_activations(s, b, h, a, tp=8)
    assert tp - plain / 8 == pytest.approx(10 * s * b * h * (1 - 1 / 8))  # the replicated 10 sbh
    assert transformer_layer_activations(s, b, h, a, recompute=True) == 2 * s * b * h
    assert (
        transformer_layer_activations(s, b, h, a, flash_attention=True) == 34 * s * b * h
    )  # no s x s scores


def test_sharded_fp32_bytes_stage_shares():
    units, N = [2145, 2244, 2244, 340], 4
    ddp = sharded_fp32_bytes(units, 10, N, 0)
    s3 = sharded_fp32_bytes(units, 10, N, 3)
    assert ddp["parameters"] == 4 * sum(units)
    assert s3["parameters"] == 4 * (537 + 561 + 561 + 85)
    assert sharded_fp32_bytes(units, 10, 1, 3)["sent"] == 0
    assert s3["sent"] == pytest.approx(1.5 * sharded_fp32_bytes(units, 10, N, 2)["sent"])
    # torch's DDP: its buckets are a flat copy of the gradients (none in a world of one, which runs without DDP)
    assert (
        ddp["ddp_buckets"] == ddp["gradients"]
        and sharded_fp32_bytes(units, 10, 1, 0)["ddp_buckets"] == 0
    )
    assert "ddp_buckets" not in s3


def test_residual_mlp_formulas_match_common_memory_and_flop_counter():
    from common.measure.memory import residual_mlp_activation_bytes

    for ck in (False, True):
        assert residual_mlp_activations(8, 33, 2, ck) == residual_mlp_activation_bytes(8, 33, 2, ck)
    torch.manual_seed(0)
    model, x = ResidualMLP(16, 2), torch.randn(5, 64)
    with FlopCounterMode(display=False) as fc:
        model(x).sum().backward()
    assert fc.get_total_flops() == residual_mlp_flops(5, 16, 2)


def test_gpt_params_and_flops_match_the_module():
    c = GPT(
        layers=2, hidden=16, heads=2, vocab=17, seq=8
    )  # the shared GPT, attention written as matmuls
    model = CausalTransformer(c.vocab, c.hidden, c.heads, c.layers, max_len=c.seq).set_attention(
        matmul_attention
    )
    assert sum(p.numel() for p in model.parameters()) == gpt_params(c)["total"]
    tokens = torch.randint(0, c.vocab, (3, c.seq))
    with FlopCounterMode(display=False) as fc:
        model(tokens).sum().backward()
    assert fc.get_total_flops() == gpt_flops(c, 3)["total"]


def test_alpha_beta_fit_recovers_its_inputs_and_mfu():
    steps, sent = [2, 2, 2, 6], [1e3, 1e5, 1e7, 1e6]
    seconds = [3e-5 * s + 2e-9 * b for s, b in zip(steps, sent)]
    alpha, beta = fit_alpha_beta(steps, sent, seconds)
    assert alpha == pytest.approx(3e-5) and beta == pytest.approx(2e-9)
    assert ring_time("all_reduce", 4e6, 4, alpha, beta) == pytest.approx(6 * 3e-5 + 6e6 * 2e-9)
    assert mfu(1e15, 2.0, 4, 250e12) == 0.5
    assert (
        in_flight_micro_batches("gpipe", 4, 8) == 8 and in_flight_micro_batches("1f1b", 4, 8) == 4
    )
    assert in_flight_micro_batches("1f1b", 4, 8, stage=3) == 1
    assert math.isnan(mfu(float("nan"), 1.0, 1, 1.0))


def test_planner_70b_fits_and_bad_degrees_are_refused():
    from common.planning.assumptions import NAMED, Assumptions, PlanError, shape_for_params
    from common.planning.planner import plan

    assert abs(gpt_params(shape_for_params(70e9))["total"] - 70e9) / 70e9 < 0.01
    rows = plan(NAMED["70b"], Assumptions(gpus=64))
    fit = [r for r in rows if r["fits"]]
    assert fit and all(r["dp"] * r["tp"] * r["pp"] * r["cp"] == 64 for r in rows)
    assert all(r["memory"]["total"] <= 72e9 for r in fit)
    assert fit[0]["step_s"] == min(r["step_s"] for r in fit)
    bad_ones = (
        dict(pp=32),
        dict(tp=3),
        dict(gpus=-1),
        dict(efficiency=float("nan")),
        dict(alpha_us=float("nan")),
        dict(gpus=48, cp=3),
    )  # cp 3 does not divide 4096 tokens
    for bad in bad_ones:
        with pytest.raises(PlanError):
            plan(NAMED["70b"], Assumptions(**{"gpus": 64, **bad}))


def test_megatron_fp32_main_gradients_are_6_plus_12_over_d():
    # Megatron-Core's distributed optimizer, bf16 parameters with fp32 main gradients: 6 + 12/d bytes per parameter
    for d in (1, 8, 64):
        assert zero_mixed_bytes(1e9, d, 1, grad_bytes=4)["total"] == pytest.approx(
            (6 + 12 / d) * 1e9
        )
    with pytest.raises(ValueError):
        zero_mixed_bytes(1e9, 8, 1, grad_bytes=3)


def lesson18():
    return importlib.import_module("lessons.21_planning")


def test_planner_rows_hold_the_lessons_closed_forms():
    # each of these fails if the planner leaves the recomputed forward out of the step time, counts the dp
    # gradients as fp32, shards ZeRO over dp instead of dp x cp, drops the recomputed layer's activations, or
    # charges ZeRO-2/3 once per step instead of once per micro-batch
    from common.harness.results import Report

    report = Report()
    lesson18().planner_closed_forms(report)
    claims = report.results["claims"]
    assert set(claims) == {
        "planner_ddp_memory",
        "planner_ckpt_activations",
        "planner_zero3_over_dp_x_cp",
        "planner_ddp_sends_bf16",
        "planner_zero2_per_micro_batch",
        "planner_zero3_per_micro_batch",
        "planner_ckpt_adds_a_forward",
    }
    assert report.failing() == [], {k: c["value"] for k, c in claims.items()}


def test_planner_zero3_memory_at_cp2_is_half_of_cp1_and_the_gradient_dtype_is_an_assumption():
    from common.planning.assumptions import NAMED, Assumptions, describe
    from common.planning.planner import evaluate_layout

    c, a = NAMED["7b"], Assumptions(gpus=8, global_batch=64)

    def states(r):
        return sum(r["memory"][k] for k in ("parameters", "gradients", "optimizer_state"))

    cp1, cp2 = (
        evaluate_layout(c, a, 4, 1, 1, 1, 3, False),
        evaluate_layout(c, a, 4, 1, 1, 2, 3, False),
    )
    assert states(cp2) == pytest.approx(states(cp1) / 2)
    psi = gpt_params(c)["total"]
    view = Assumptions(gpus=8, global_batch=64, gradient_as_bucket_view=True)
    assert (
        evaluate_layout(c, view, 8, 1, 1, 1, 0, False)["memory"]["gradients"] == 2 * psi
    )  # no bucket copy
    assert evaluate_layout(c, a, 8, 1, 1, 1, 0, False)["memory"]["gradients"] == 4 * psi  # the copy
    fp32 = Assumptions(gpus=8, global_batch=64, grad_bytes=4)
    r = evaluate_layout(c, fp32, 8, 1, 1, 1, 1, False)
    assert r["memory"]["gradients"] == 4 * psi and r["sent"]["dp"] == pytest.approx(
        (4 + 2) * psi * 7 / 8
    )
    assert "gradients fp32" in describe(c, fp32)[4] and "bf16" in describe(c, a)[4]
    assert not any("upper bound" in line for line in describe(c, a))


def test_planner_megatron_zero1_fit_map_cell_tp8_pp1_does_not_fit_with_fp32_gradients():
    from common.planning.assumptions import NAMED, Assumptions
    from common.planning.planner import evaluate_layout

    bf16 = evaluate_layout(NAMED["70b"], Assumptions(gpus=64), 8, 8, 1, 1, 1, False)
    fp32 = evaluate_layout(NAMED["70b"], Assumptions(gpus=64, grad_bytes=4), 8, 8, 1, 1, 1, False)
    assert round(bf16["memory"]["total"] / 1e9, 1) == 56.3 and bf16["fits"]
    assert round(fp32["memory"]["total"] / 1e9, 1) == 72.6 and not fp32["fits"]


def test_planner_expresses_llama3_405b_128k_stage_and_names_the_constraint():
    from common.planning.assumptions import Assumptions, PlanError, shape_for_params
    from common.planning.planner import plan

    c = shape_for_params(405e9, seq=131072)
    a = Assumptions(
        gpus=16384, tp=8, cp=16, pp=16, global_batch=128, grad_bytes=4
    )  # cp 16 leaves the node
    rows = plan(c, a)
    assert {(r["dp"], r["tp"], r["pp"], r["cp"]) for r in rows} == {(8, 8, 16, 16)} and any(
        r["fits"] for r in rows
    )
    with pytest.raises(PlanError, match="global-batch 100 is not a multiple of dp"):
        plan(c, Assumptions(gpus=16384, tp=8, cp=16, pp=16, global_batch=100))
    with pytest.raises(
        PlanError, match="tp x pp x cp = 8 x 16 x 16 = 2048 does not divide --gpus 1024"
    ):
        plan(c, Assumptions(gpus=1024, tp=8, cp=16, pp=16))


def test_meta_init_compares_buffers_and_a_parameters_only_recipe_fails():
    import torch

    from common.planning.transformer import init_weights

    lesson, cpu = lesson18(), torch.device("cpu")
    assert lesson.meta_init_gap(lesson.materialise, cpu, 0) == 0.0

    def init_weights_only(
        model, device, seed
    ):  # the old recipe: to_empty, then the parameters alone
        model.to_empty(device=device)
        with torch.no_grad():
            init_weights(model, seed)
        return model

    def buffers_left_zero(
        model, device, seed
    ):  # every parameter right, BatchNorm's buffers as fresh pages
        lesson.materialise(model, device, seed)
        for b in model.buffers():
            b.zero_()
        return model

    for wrong in (init_weights_only, buffers_left_zero):
        assert lesson.meta_init_gap(wrong, cpu, 0) != 0.0, wrong.__name__  # a NaN is != 0 too


def test_the_comparison_sees_non_persistent_buffers_and_the_recipe_has_the_stated_limit():
    """A causal mask registered with persistent=False is in no state_dict; the comparison reads it anyway, and
    `reset_parameters()` leaves it as `to_empty` left it: the docstring's limit, shown."""
    import torch

    lesson, cpu = lesson18(), torch.device("cpu")

    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)

    assert "mask" in lesson.every_tensor(Masked()) and "mask" not in Masked().state_dict()
    torch.manual_seed(0)
    eager = lesson.every_tensor(Masked())
    with torch.device("meta"):
        model = Masked()
    torch.use_deterministic_algorithms(
        True
    )  # uninitialised memory is filled with NaN: made visible
    try:
        lazy = lesson.every_tensor(lesson.materialise(model, cpu, 0))
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(lazy["fc.weight"], eager["fc.weight"]) and not torch.equal(
        lazy["mask"], eager["mask"]
    )


def test_data_parallel_runs_on_nvlink_while_the_job_fits_in_one_node():
    """DDP on 8 GPUs of one node: the step is compute + one ring all-reduce of the bf16 gradients on NVLink,
    14 alpha + 2 (7/8) 2 Psi / B_nvlink; spread over two nodes of 4 the same bytes cross the network."""
    from common.planning.assumptions import NAMED, Assumptions
    from common.planning.planner import evaluate_layout

    c = NAMED["7b"]
    for per_node, link_gbps in ((8, 3600.0), (4, 400.0)):
        a = Assumptions(
            gpus=8, global_batch=64, gpus_per_node=per_node, nvlink_gbps=3600.0, network_gbps=400.0
        )
        row = evaluate_layout(c, a, 8, 1, 1, 1, 0, False)
        compute = gpt_flops(c, a.global_batch)["total"] / (
            a.gpus * a.peak_tflops * 1e12 * a.efficiency
        )
        psi = gpt_params(c)["total"]
        want = 14 * a.alpha_us * 1e-6 + 2 * 7 / 8 * 2 * psi / (link_gbps / 8 * 1e9)
        assert row["step_s"] - compute == pytest.approx(want, rel=1e-12), per_node


def test_a_recomputed_forward_passes_the_cp_ring_once_more():
    """Ring attention: K and V go around the ring once forward and twice backward; full checkpointing adds the
    recomputed forward's pass: 4/3 of the bytes."""
    from common.planning.assumptions import NAMED, Assumptions
    from common.planning.planner import evaluate_layout

    c, a = NAMED["7b"], Assumptions(gpus=8, global_batch=64)
    plain, ckpt = (evaluate_layout(c, a, 4, 1, 1, 2, 1, ck)["sent"]["cp"] for ck in (False, True))
    assert ckpt == pytest.approx(4 / 3 * plain, rel=1e-12) and plain > 0
