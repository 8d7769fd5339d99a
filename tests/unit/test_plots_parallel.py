"""The tensor-parallel picture finds each rank's shard by value, so a wrong split draws as a wrong picture."""

import matplotlib

matplotlib.use("Agg")

import torch  # noqa: E402

from common.plots.parallel import locate_shard, owner_map, plot_tp_shards  # noqa: E402
from common.tensor_parallel.layers import MLP, ColumnParallelLinear, RowParallelLinear  # noqa: E402


def test_owner_map_finds_column_and_row_shards():
    torch.manual_seed(0)
    full = MLP(8)  # fc1 (32, 8), fc2 (8, 32)
    w1 = [ColumnParallelLinear(full.fc1, r, 2).weight.detach() for r in range(2)]
    w2 = [RowParallelLinear(full.fc2, r, 2, group=None).weight.detach() for r in range(2)]
    assert owner_map(full.fc1.weight.detach(), w1, 0)[:, 0].tolist() == [0] * 16 + [1] * 16
    assert owner_map(full.fc2.weight.detach(), w2, 1)[0].tolist() == [0] * 16 + [1] * 16
    h = torch.randn(6, 32)
    fig = plot_tp_shards(
        full.fc1.weight.detach(), full.fc2.weight.detach(), w1, w2, h, list(h.chunk(2, 1))
    )
    assert len(fig.axes) == 3


def test_a_wrong_split_is_held_by_no_rank():
    full = torch.arange(32.0).view(8, 4)
    wrong = list(full.chunk(2, 1))  # cut by columns where rows were meant
    assert locate_shard(full, wrong[0], 0) is None
    assert owner_map(full, wrong, 0).eq(-1).all()
    assert locate_shard(full, full[4:] + 1e-3, 0) is None  # a changed value is not the shard
