"""common/measure/memory.py and common/measure/precision.py: lesson 08's byte counts, in one process (no torchrun)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from common.measure.differences import max_abs_diff_all
from common.measure.memory import (
    held_bytes,
    residual_mlp_activation_bytes,
    saved_activation_bytes,
    saved_bytes,
    storage_bytes,
)
from common.measure.precision import autocast_context
from common.models import ResidualMLP


def test_storage_bytes_counts_each_storage_once():
    x = torch.zeros(10, 4)  # 160 bytes
    assert storage_bytes([x, x, x[:2], x.view(40), None]) == 160  # views and repeats add nothing
    assert storage_bytes([x, torch.zeros(3, dtype=torch.float16)]) == 166
    assert storage_bytes([x[:2].clone()]) == 32  # a copy owns only its own bytes


@pytest.mark.parametrize("width, depth, batch", [(16, 1, 3), (32, 2, 8), (64, 3, 5)])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_saved_activation_bytes_match_the_shapes_exactly(width, depth, batch, checkpointing):
    torch.manual_seed(0)
    model = ResidualMLP(width, depth)
    model.checkpointing = checkpointing
    measured = saved_activation_bytes(model, lambda: model(torch.randn(batch, 1, 8, 8)))
    assert measured == residual_mlp_activation_bytes(batch, width, depth, checkpointing)


def test_checkpointing_keeps_the_gradients():
    torch.manual_seed(0)
    model, x, y = ResidualMLP(32, 2), torch.randn(8, 1, 8, 8), torch.randint(10, (8,))
    grads = []
    for ck in (False, True):
        model.checkpointing = ck
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert max_abs_diff_all(*grads) < 1e-6


def test_bytes_a_rank_holds_with_adam_exactly():
    torch.manual_seed(0)
    model = ResidualMLP(32, 2)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters())
    torch.nn.functional.cross_entropy(model(torch.randn(4, 64)), torch.randint(10, (4,))).backward()
    opt.step()
    params = list(model.parameters())
    held = held_bytes(params, [p.grad for p in params], opt, together=True)
    tensors = len(list(model.parameters()))
    assert held == {
        "parameters": 4 * n,
        "gradients": 4 * n,
        "optimizer_state": 8 * n + 4 * tensors,
        "all_three_counted_together": 16 * n + 4 * tensors,
    }


def test_autocast_context_by_name():
    assert isinstance(autocast_context(torch.device("cpu"), "fp32"), nullcontext)
    with autocast_context(torch.device("cpu"), "bf16"):
        assert (
            torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.bfloat16
        )
    with pytest.raises(ValueError):
        autocast_context(torch.device("cpu"), "fp8")


@pytest.mark.parametrize("width, depth, batch", [(16, 1, 3), (64, 2, 8)])
def test_bf16_autocast_saves_half_the_activations_plus_weight_copies(width, depth, batch):
    """Lesson 08's bf16 claim: plain / 2 + 2 bytes x every Linear weight but the stem's (its input needs no grad)."""
    torch.manual_seed(0)
    model, x = ResidualMLP(width, depth), torch.randn(batch, 1, 8, 8)
    plain = saved_activation_bytes(model, lambda: model(x))
    with autocast_context(torch.device("cpu"), "bf16"):
        bf16 = saved_activation_bytes(model, lambda: model(x))
    copies = 2 * sum(
        p.numel() for n, p in model.named_parameters() if n.endswith("weight") and n[:4] != "stem"
    )
    assert bf16 == plain // 2 + copies


def test_saved_bytes_counts_a_storage_once_or_each_view_by_its_own_bytes():
    """Storage mode: a slice saved for backward counts its whole base (what memory holds); views mode counts
    the rows a pipeline stage's micro-batch really is; weights excluded either way."""
    lin, x = torch.nn.Linear(8, 4), torch.randn(10, 8, requires_grad=True)
    with saved_bytes(exclude=lin.parameters()) as whole:
        lin(x[:2])
    with saved_bytes(exclude=lin.parameters(), views=True) as rows:
        lin(x[:2])
    assert whole.bytes == 10 * 8 * 4 and rows.bytes == 2 * 8 * 4
    assert whole.tensors == rows.tensors == 1


def test_held_now_reads_the_size_a_saved_storage_has_after_the_forward():
    w = torch.randn(4, 4, requires_grad=True)
    gathered = w * 1  # a weight gathered for the forward, freed (resized to 0 bytes) right after it
    x = torch.randn(3, 4, requires_grad=True)
    with saved_bytes(exclude=[w]) as saved:
        out = x @ gathered
    gathered.untyped_storage().resize_(0)
    assert saved.bytes == 4 * 4 * 4 + 3 * 4 * 4  # the gathered weight and x, when they were saved
    assert saved.held_now() == 3 * 4 * 4  # only x still holds memory
    del out


def test_the_model_counts_its_activations_and_bf16_weight_copies():
    model, x = ResidualMLP(16, 2), torch.randn(6, 1, 8, 8)
    for ck in (False, True):
        assert model.activation_bytes(x[:3], ck) == residual_mlp_activation_bytes(3, 16, 2, ck)
    assert model.checkpointing is False  # left as it was
    assert model.bf16_weight_copy_bytes() == 2 * (2 * 2 * 16 * 16 + 16 * 10)
