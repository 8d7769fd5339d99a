"""The measurements behind notebooks 05-08's pictures (common/plots/data_movement.py, common.data_parallel.seeding.describe_pairs)."""

import torch
import torch.nn.functional as F

from common.data_parallel.seeding import describe_pairs
from common.measure.memory import residual_mlp_activation_bytes
from common.models import ResidualMLP
from common.plots.data_movement import micro_step_timelines, one_process_group, saved_bytes_timeline


def test_describe_pairs_names_the_main_process_and_workers():
    assert (
        describe_pairs({"identical_pairs": ["r0w-1=r1w-1"]})
        == "rank 0 main process = rank 1 main process"
    )
    assert (
        describe_pairs({"identical_pairs": ["r0w0=r1w0", "r0w1=r1w1"]})
        == "rank 0 worker 0 = rank 1 worker 0; rank 0 worker 1 = rank 1 worker 1"
    )
    assert describe_pairs({"identical_pairs": []}) == "none"


def test_saved_bytes_timeline_peaks_at_the_shapes_formula_and_frees_everything():
    torch.manual_seed(0)
    net, x, y = ResidualMLP(width=32, depth=2), torch.randn(8, 1, 8, 8), torch.randint(10, (8,))
    for ck in (False, True):
        net.checkpointing = ck
        timeline = saved_bytes_timeline(net, lambda: net(x), lambda out: F.cross_entropy(out, y))
        assert max(b for _, b in timeline) == residual_mlp_activation_bytes(8, 32, 2, ck)
        assert timeline[-1] == ("backward", 0)  # backward released every saved tensor
        assert timeline[0][0] == "forward"


def test_no_sync_timeline_one_round_in_the_last_micro_step():
    with one_process_group():
        rows = next(micro_step_timelines(k=3))
    buckets = len(rows["accumulate"])
    assert (
        buckets >= 1 and rows["accumulate"] == [2] * buckets
    )  # only the last micro-step all-reduces
    for wrong in ("accumulate_backward_only_no_sync", "accumulate_always_sync"):
        assert rows[wrong] == [m for m in range(3) for _ in range(buckets)]
