"""common/expert_parallel/moe.py in one process: routing, capacity and drops counted, the balance loss, EP at ep = 1."""

from __future__ import annotations

import math

import pytest
import torch

from common.expert_parallel.moe import (
    ExpertParallelMoE,
    MoE,
    balance_loss,
    capacity,
    check_moe_options,
    dispatch_plan,
    histogram,
    keep_mask,
    route,
)


def test_route_renormalizes_the_top_k_weights():
    logits = torch.randn(50, 6, generator=torch.Generator().manual_seed(0))
    probs, weights, idx = route(logits, 2)
    assert torch.allclose(probs.sum(-1), torch.ones(50))
    assert torch.allclose(weights.sum(-1), torch.ones(50))
    assert torch.equal(
        route(logits, 1)[1][:, 0], probs.max(-1).values
    )  # top-1: the probability itself
    assert (idx[:, 0] == logits.argmax(-1)).all()
    assert (weights[:, 0] >= weights[:, 1]).all()


def test_keep_mask_fills_first_choices_first_and_drops_exactly_the_overflow():
    idx = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]])  # expert 0 wanted 4 times, capacity 2
    keep = keep_mask(idx, 3, 2)
    # first choices in token order: tokens 0, 1 take expert 0's 2 places, token 2's first choice is dropped;
    # expert 1: token 3's first choice, then token 0's second choice; token 1's second choice is one too many
    assert keep.tolist() == [[True, True], [True, False], [False, True], [True, False]]
    counts = histogram(idx, 3)
    assert idx.numel() - int(keep.sum()) == int((counts - 2).clamp(min=0).sum())
    assert capacity(4, 3, 2, 1.0) == 3 and capacity(10, 4, 1, 1.25) == 4


def test_a_token_with_every_choice_dropped_gets_exactly_zero():
    torch.manual_seed(0)
    moe = MoE(8, 4, k=1, capacity_factor=0.25)
    x = torch.randn(40, 8)
    y = moe(x)
    dropped = ~moe.stats["keep"].any(-1)
    assert dropped.sum() > 0
    assert (y[dropped] == 0).all() and (y[~dropped] != 0).any(-1).all()
    assert moe.stats["dropped"] == int((moe.stats["counts"] - moe.stats["cap"]).clamp(min=0).sum())


def test_balance_loss_is_one_when_balanced_and_larger_when_skewed():
    e = 4
    uniform = torch.full((8, e), 1 / e)
    balanced = torch.arange(8).remainder(e)[:, None]  # every expert twice
    assert math.isclose(balance_loss(uniform, balanced).item(), 1.0, rel_tol=1e-6)
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(8, 1)
    assert balance_loss(skewed, torch.zeros(8, 1, dtype=torch.long)).item() == pytest.approx(2.8)


def test_balance_loss_counts_assignments_not_tokens_at_top_2():
    """f_e is a fraction of the N x k assignments: balanced top-2 routing gives 1.0, as at top-1 (a loss
    dividing by the N tokens instead would give k = 2.0 here)."""
    e, n = 4, 8
    uniform = torch.full((n, e), 1 / e)
    top2 = torch.stack(
        [torch.arange(n) % e, (torch.arange(n) + 1) % e], dim=1
    )  # each expert 4 times
    assert histogram(top2, e).tolist() == [4, 4, 4, 4]
    assert math.isclose(balance_loss(uniform, top2).item(), 1.0, rel_tol=1e-6)
    everyone_on_0_and_1 = torch.tensor([[0, 1]]).repeat(
        n, 1
    )  # f = (1/2, 1/2, 0, 0): E x (1/2 + 1/2) / E = 1
    skewed = torch.tensor([[0.4, 0.4, 0.1, 0.1]]).repeat(n, 1)
    assert balance_loss(skewed, everyone_on_0_and_1).item() == pytest.approx(
        4 * (0.5 * 0.4 + 0.5 * 0.4)
    )


def test_dispatch_plan_groups_by_destination_rank():
    idx = torch.tensor([[3, 0], [1, 2], [2, 3]])
    keep = torch.ones_like(idx, dtype=torch.bool)
    tok, slot, send = dispatch_plan(idx, keep, experts_per_rank=2, ep=2)
    assert idx[tok, slot].tolist() == [0, 1, 2, 2, 3, 3] and send.tolist() == [2, 4]


def test_expert_parallel_at_ep1_equals_the_moe_forward_and_backward():
    torch.manual_seed(1)
    full = MoE(8, 4, k=2, capacity_factor=1.0)
    ep = ExpertParallelMoE(full, 0, 1, None)
    x = torch.randn(30, 8)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = full(xa), ep(xb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert torch.allclose(ya, yb, atol=1e-6) and torch.allclose(xa.grad, xb.grad, atol=1e-6)
    for (_, p), (_, q) in zip(full.named_parameters(), ep.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)


@pytest.mark.parametrize(
    "bad",
    [
        dict(experts=4, k=5, capacity_factor=1.0),
        dict(experts=4, k=1, capacity_factor=0),
        dict(experts=4, k=1, capacity_factor=1e30),
        dict(experts=4, k=1, capacity_factor=math.nan),
        dict(experts=3, k=1, capacity_factor=1.0, ep=2),
    ],
)
def test_bad_options_are_refused(bad):
    with pytest.raises(ValueError):
        check_moe_options(**bad)
