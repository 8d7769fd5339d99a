"""common/context_parallel/ring_attention.py, common/context_parallel/ulysses.py and the causal transformer of common/models.py: the log-sum-exp
merge, the splits' positions and exact work counts in one process; ring and Ulysses attention (forward and
q, k, v gradients) equal to SDPA on the whole sequence in spawned gloo worlds of 2 and 4; NaN stays NaN."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from common.context_parallel.ring_attention import (
    RingStats,
    Split,
    block_attention,
    causal_pairs,
    merge,
    owners,
    ring_attention,
)
from common.data import PIXEL_VOCAB, digit_sequences, next_token_targets
from common.measure.differences import max_abs_diff
from common.models import CausalTransformer
from tests._19_workers import ring_vs_sdpa
from tests._workers import run_world


def qkv(S=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, S, 8, generator=g, dtype=torch.float64) for _ in range(3)]


def test_two_blocks_merged_by_log_sum_exp_equal_attention_on_both():
    q, k, v = qkv()
    want = F.scaled_dot_product_attention(q, k, v)  # no mask: every query sees all 16 keys
    a = block_attention(q, k[:, :, :5], v[:, :, :5], False)  # keys 0..4
    b = block_attention(q, k[:, :, 5:], v[:, :, 5:], False)  # keys 5..15
    out, lse = merge(*a, *b)
    assert max_abs_diff(out, want) <= 1e-12
    assert max_abs_diff(lse, torch.logsumexp(q @ k.transpose(-2, -1) / math.sqrt(8), -1)) <= 1e-12
    averaged = (a[0] + b[0]) / 2  # the tempting wrong merge
    assert max_abs_diff(averaged, want) > 1e-2


def test_a_nan_in_one_block_makes_the_difference_nan_not_small():
    q, k, v = qkv()
    k[0, 0, 3, 0] = float("nan")
    out, _ = merge(
        *block_attention(q, k[:, :, :8], v[:, :, :8], False),
        *block_attention(q, k[:, :, 8:], v[:, :, 8:], False),
    )
    assert math.isnan(max_abs_diff(out, F.scaled_dot_product_attention(*qkv())))
    out1 = ring_attention(q, k, v, Split("zigzag", 1))  # cp = 1: one process, the same rule
    assert math.isnan(max_abs_diff(out1, F.scaled_dot_product_attention(*qkv(), is_causal=True)))


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
def test_one_process_ring_equals_causal_sdpa_with_gradients(kind):
    q, k, v = (t.requires_grad_() for t in qkv())
    stats = RingStats()
    out = ring_attention(q, k, v, Split(kind, 1), None, stats)
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, is_causal=True)
    assert max_abs_diff(out, want) <= 1e-12
    out.square().sum().backward()
    want.square().sum().backward()
    assert max(max_abs_diff(a.grad, b.grad) for a, b in zip((q, k, v), ref)) <= 1e-12
    assert stats.pairs == causal_pairs(16) and stats.sent == {"forward": 0, "backward": 0}


def test_splits_cover_the_sequence_once_and_zigzag_pairs_a_head_with_a_tail():
    for split in (Split("contiguous", 4), Split("zigzag", 4)):
        got = torch.cat([split.positions(r, 64) for r in range(4)]).sort().values
        assert torch.equal(got, torch.arange(64))
    assert Split("zigzag", 4).positions(0, 16).tolist() == [0, 1, 14, 15]
    with pytest.raises(ValueError, match="not divisible"):
        Split("zigzag", 4).chunk_len(12)  # 8 chunks


def test_owners_names_the_rank_whose_keys_a_block_is_and_minus_1_for_anything_else():
    k = qkv(S=16)[1]
    split = Split("zigzag", 4)
    blocks = [split.take(k, 2, 2), split.take(k, 0, 2), split.take(k, 0, 2) + 1e-7, k[:, :, :4]]
    assert owners(blocks, k, split) == [2, 0, -1, -1]  # exact: a block that arrived is bit-equal


def test_digit_sequences_are_pixel_tokens_and_targets_shift_by_one():
    train, test = digit_sequences()
    assert train.shape == (1438, 64) and test.shape == (359, 64)
    assert train.min() == 0 and train.max() == PIXEL_VOCAB - 1
    y = next_token_targets(train[:2])
    assert torch.equal(y[:, :-1], train[:2, 1:]) and (y[:, -1] == -100).all()


def test_transformer_positions_default_to_the_whole_sequence_and_attention_is_swappable():
    torch.manual_seed(0)
    model = CausalTransformer()
    tokens = digit_sequences()[0][:3]
    want = model(tokens)
    assert want.shape == (3, 64, PIXEL_VOCAB)
    assert max_abs_diff(model(tokens, torch.arange(64)), want) == 0.0
    model.set_attention(lambda q, k, v: ring_attention(q, k, v, Split("zigzag", 1)))
    assert max_abs_diff(model(tokens), want) <= 1e-5


@pytest.mark.slow  # three spawned worlds of 4 processes: about 10 s, kept out of the fast subset
@pytest.mark.timeout(240)
def test_ring_and_ulysses_equal_sdpa_and_count_their_bytes_and_pairs(tmp_path):
    world_size = 4  # (cp = 2 is launched by tests/lessons/test_19_context_parallel.py, in float32)
    blk = 2 * 4 * (16 // world_size) * 8 * 8  # k (or v) of one rank: (2, 4, 16/cp, 8) float64
    for kind in ("contiguous", "zigzag", "ulysses"):
        (tmp_path / kind).mkdir()
    for kind in ("contiguous", "zigzag"):
        ranks = run_world(ring_vs_sdpa, world_size, tmp_path / kind, kind)
        for r in ranks:
            assert max(r["diffs"]) <= 1e-12, r
            want = {
                "forward": (world_size - 1) * 2 * blk,
                "backward": (2 * world_size - 1) * 2 * blk,
            }
            assert r["sent"] == want
        pairs = [r["pairs"] for r in ranks]
        assert sum(pairs) == causal_pairs(16)
        assert (max(pairs) == min(pairs)) == (kind == "zigzag")
        for rank, r in enumerate(
            ranks
        ):  # rank 1 holds 1, 0, 3, 2: the block of rank r - s, by its values
            assert r["held"] == [(rank - s) % world_size for s in range(world_size)]
    for r in run_world(ring_vs_sdpa, world_size, tmp_path / "ulysses", "contiguous", True):
        assert max(r["diffs"]) <= 1e-12, r


def test_a_nan_input_makes_the_lessons_equality_claims_fail(monkeypatch):
    """The lesson's own path (ring_run, Report.claim) on q, k, v with one NaN: the claim does not hold."""
    import importlib

    from common.harness.env import DistInfo
    from common.harness.grid import Grid
    from common.harness.results import Report

    lesson = importlib.import_module("lessons.19_context_parallel")
    args = lesson.parse_args([])
    clean = lesson.qkv

    def with_nan(*a):
        q, k, v = clean(*a)
        k[0, 0, 5, 0] = float("nan")
        return [q, k, v]

    monkeypatch.setattr(lesson, "qkv", with_nan)
    report = Report(DistInfo())
    run = lesson.Run(args, DistInfo(), report, Grid(DistInfo(), cp=1))
    runs = lesson.ring_equals_full(run)
    assert math.isnan(runs["zigzag"]["diff"])
    claims = report.results["claims"]
    assert (
        not claims["ring_zigzag_equals_sdpa"]["holds"]
        and not claims["ring_contiguous_equals_sdpa"]["holds"]
    )
    lesson.ulysses(run, runs)
    assert not report.results["claims"]["ulysses_equals_sdpa"]["holds"]
