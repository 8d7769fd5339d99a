"""The cost model of lesson 18 (common/planning.py): published numbers, exact small cases, FLOPs vs the counter."""
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from common.gpt import matmul_attention
from common.models import CausalTransformer
from common.memory import ResidualMLP
from common.planning import (GPT, fit_alpha_beta, gpt_flops, gpt_params, in_flight_micro_batches, mfu,
                             residual_mlp_activations, residual_mlp_flops, ring_time, sharded_fp32_bytes,
                             transformer_layer_activations, zero_mixed_bytes, zero_paper_activations)


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
    assert transformer_layer_activations(s, b, h, a, flash_attention=True) == 34 * s * b * h  # no s x s scores


def test_sharded_fp32_bytes_stage_shares():
    units, N = [2145, 2244, 2244, 340], 4
    ddp = sharded_fp32_bytes(units, 10, N, 0)
    s3 = sharded_fp32_bytes(units, 10, N, 3)
    assert ddp["parameters"] == 4 * sum(units)
    assert s3["parameters"] == 4 * (537 + 561 + 561 + 85)
    assert sharded_fp32_bytes(units, 10, 1, 3)["sent"] == 0
    assert s3["sent"] == pytest.approx(1.5 * sharded_fp32_bytes(units, 10, N, 2)["sent"])


def test_residual_mlp_formulas_match_common_memory_and_flop_counter():
    from common.memory import residual_mlp_activation_bytes
    for ck in (False, True):
        assert residual_mlp_activations(8, 33, 2, ck) == residual_mlp_activation_bytes(8, 33, 2, ck)
    torch.manual_seed(0)
    model, x = ResidualMLP(16, 2), torch.randn(5, 64)
    with FlopCounterMode(display=False) as fc:
        model(x).sum().backward()
    assert fc.get_total_flops() == residual_mlp_flops(5, 16, 2)


def test_gpt_params_and_flops_match_the_module():
    c = GPT(layers=2, hidden=16, heads=2, vocab=17, seq=8)  # the shared GPT, attention written as matmuls
    model = CausalTransformer(c.vocab, c.hidden, c.heads, c.layers, max_len=c.seq).set_attention(matmul_attention)
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
    assert in_flight_micro_batches("gpipe", 4, 8) == 8 and in_flight_micro_batches("1f1b", 4, 8) == 4
    assert in_flight_micro_batches("1f1b", 4, 8, stage=3) == 1
    assert math.isnan(mfu(float("nan"), 1.0, 1, 1.0))


def test_planner_70b_fits_and_bad_degrees_are_refused():
    from common.planner import NAMED, Assumptions, PlanError, plan, shape_for_params
    assert abs(gpt_params(shape_for_params(70e9))["total"] - 70e9) / 70e9 < 0.01
    rows = plan(NAMED["70b"], Assumptions(gpus=64))
    fit = [r for r in rows if r["fits"]]
    assert fit and all(r["dp"] * r["tp"] * r["pp"] * r["cp"] == 64 for r in rows)
    assert all(r["memory"]["total"] <= 72e9 for r in fit)
    assert fit[0]["step_s"] == min(r["step_s"] for r in fit)
    bad_ones = (dict(pp=32), dict(tp=3), dict(gpus=-1), dict(efficiency=float("nan")),
                dict(alpha_us=float("nan")), dict(gpus=48, cp=3))  # cp 3 does not divide 4096 tokens
    for bad in bad_ones:
        with pytest.raises(PlanError):
            plan(NAMED["70b"], Assumptions(**{"gpus": 64, **bad}))
