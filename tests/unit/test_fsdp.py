"""common/sharding/fsdp.py without a process group: the predicted bytes from the shapes (a shard group of one
rank still all-reduces across replicas), and `init_like_eager` equal to eager construction on a plain model."""

from __future__ import annotations

import torch

from common.sharding.fsdp import NormalisedMLP, init_like_eager, padded_bytes, predicted_step_bytes


def test_a_shard_group_of_one_gathers_nothing_and_all_reduces_every_gradient():
    model = NormalisedMLP(32, 2)
    replicas = predicted_step_bytes(model, shard=1, replicate=4)  # 4 ranks, --replicate 4
    full = 4 * sum(p.numel() for p in model.parameters())
    assert replicas == {"all_gather_single": 0, "reduce_scatter_single": 0, "all_reduce": full}
    hsdp = predicted_step_bytes(model, shard=2, replicate=2)  # the lesson's 2 x 2
    assert hsdp["all_reduce"] == padded_bytes(model.parameters(), 2) // 2 == 13268
    assert "all_reduce" not in predicted_step_bytes(model, shard=4, replicate=1)


def test_init_like_eager_draws_eagers_numbers_on_the_cpu():
    torch.manual_seed(3)
    eager = NormalisedMLP(16, 2)
    model = NormalisedMLP(16, 2)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.fill_(float("nan"))
    init_like_eager(model, seed=3)
    for a, b in zip(
        [*model.parameters(), *model.buffers()], [*eager.parameters(), *eager.buffers()]
    ):
        assert torch.equal(a, b)
