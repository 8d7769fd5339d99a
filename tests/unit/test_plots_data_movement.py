"""The pictures of notebooks 12 and 13 read the state they claim to draw (in process, no launch)."""

import importlib

import matplotlib

matplotlib.use("Agg")
import torch  # noqa: E402

from common.models import ResidualMLP  # noqa: E402
from common.plots.hang import parse_py_spy, shared_depth  # noqa: E402
from common.plots.zero import record_holdings, zero_probe  # noqa: E402
from common.sharding.zero import ZeRO, flat_units  # noqa: E402

lesson = importlib.import_module("lessons.13_sharded_data_parallel")

DUMP_RANK0 = """Process ...
Thread ...
    all_reduce (torch/distributed/distributed_c10d.py:3252)
    train_step (common/exhibits/worker.py:121)
    <module> (common/exhibits/worker.py:146)
"""
DUMP_RANK1 = """Process ...
Thread ...
    train_step (common/exhibits/worker.py:123)
    <module> (common/exhibits/worker.py:146)
"""


def test_py_spy_stacks_part_where_the_lines_differ():
    stacks = [parse_py_spy(DUMP_RANK0), parse_py_spy(DUMP_RANK1)]
    assert stacks[0][0] == ("<module>", "common/exhibits/worker.py:146")  # outermost first
    assert stacks[0][-1][0] == "all_reduce"
    assert shared_depth(stacks) == 1  # train_step is on both, at different lines


def holdings(stage: int) -> dict:
    torch.manual_seed(0)
    m = ResidualMLP(33, 2)
    z = ZeRO(m, [u for _, u in flat_units(m)], stage=stage, group=None, lr=1e-3)
    probes = [(name, mod, zero_probe(u)) for (name, mod), u in zip(flat_units(m), z.units)]
    batch = (torch.randn(8, 64), torch.randint(10, (8,)))
    return record_holdings(m, probes, batch, z.step)


def test_stage3_gathers_one_unit_at_a_time_and_stage1_holds_gradients_until_the_step():
    rec = holdings(3)
    units = rec["units"]
    for event, state in zip(rec["events"], rec["state"]):
        whole = [u for u, (params, _) in zip(units, state) if params]
        assert whole == ([event[2:]] if event[:2] in ("F ", "B ") else []), (event, whole)
        assert not any(grads for _, grads in state), event  # reduce-scattered as soon as complete
    rec = holdings(1)
    at = dict(zip(rec["events"], rec["state"]))
    assert all(params and grads for params, grads in at["after backward"])
    assert not any(grads for _, grads in at["after step"])
