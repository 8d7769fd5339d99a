"""Instruments (common/measure/counters.py) count exactly: bytes are asserted equal, not as a lower bound."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from common.measure.memory import saved_bytes
from tests._workers import count_two_collectives, run_world


@pytest.mark.timeout(120)
def test_count_collectives_calls_bytes_and_groups(tmp_path):
    for r in run_world(count_two_collectives, 2, tmp_path, timeout_s=90):
        assert r["calls"] == {"all_reduce": 1, "all_gather_into_tensor": 1}
        assert r["bytes"] == {
            "all_reduce": 10 * 4,
            "all_gather_into_tensor": 2 * 3 * 4,
        }  # the full buffers
        assert r["groups"] == {("all_reduce", (0, 1)): 1, ("all_gather_into_tensor", (0, 1)): 1}
        assert r["restored"] == "all_reduce"  # the real function is back after the block


def test_saved_tensor_bytes_counts_each_storage_once_and_excludes_parameters():
    lin = nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    with saved_bytes(exclude=lin.parameters()) as saved:
        y = torch.relu(lin(x))  # Linear saves x (and its weight, excluded); ReLU saves its output
        (y * y).sum()  # saves y twice (both operands): one storage, counted once
    assert saved.bytes == x.numel() * 4 + y.numel() * 4
    assert saved.tensors == 2
