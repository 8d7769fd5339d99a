"""The parallelism grid (common/harness/grid.py): coordinates, groups by name, and one clear error for bad sizes."""

from __future__ import annotations

import pytest

from common.harness.env import DistInfo, LessonError
from common.harness.grid import Grid, grid_layout
from tests._workers import grid_facts, run_world

CASES = [
    (2, {"dp": 2}),
    (4, {"dp": 2, "tp": 2}),
    (4, {"pp": 2, "dp": 1, "tp": 2}),
    (4, {"dp": 4, "tp": 1}),
]


def test_layout_is_row_major_with_the_last_dimension_innermost():
    assert grid_layout({"dp": 2, "tp": 2}).tolist() == [[0, 1], [2, 3]]
    assert grid_layout({"dp": 2, "pp": 2, "tp": 2})[1, 0].tolist() == [4, 5]


def test_pp_outermost_puts_each_pipeline_across_nodes_and_tp_inside_one():
    """Lesson 11's order (torchtitan's, Megatron-LM's): pp, dp, tp. On 2 nodes of 4 consecutive ranks, every
    pp group spans both nodes and every tp and dp group stays on one; dp outermost would do the opposite for
    pp and dp."""
    node = {r: r // 4 for r in range(8)}
    grids = {
        order: Grid(DistInfo(rank=r, world_size=8), **{k: 2 for k in order})
        for order, r in ((("pp", "dp", "tp"), 5), (("dp", "pp", "tp"), 5))
    }
    for order, grid in grids.items():
        nodes = {dim: {node[m] for m in grid.ranks_in(dim)} for dim in order}
        assert nodes["tp"] == {1}
        assert (nodes["pp"], nodes["dp"]) == (({0, 1}, {1}) if order[0] == "pp" else ({1}, {0, 1}))


def test_world_of_one_without_a_process_group():
    grid = Grid(DistInfo(), dp=1, pp=1, tp=1)
    assert grid.coords == {"dp": 0, "pp": 0, "tp": 0}
    assert grid.group("tp") is None and grid.mesh is None and grid.ranks_in("dp") == [0]
    assert grid.is_first("pp") and grid.is_last("pp")


@pytest.mark.parametrize(
    "world, sizes",
    [
        (4, {"dp": 3}),
        (4, {"dp": 2, "tp": 3}),
        (8, {"dp": 2, "pp": 2}),
        (2, {"dp": 0, "tp": 2}),
        (2, {}),
    ],
)
def test_sizes_that_do_not_multiply_to_the_world_are_one_clear_error(world, sizes):
    with pytest.raises(LessonError, match="world|positive|at least one"):
        Grid(DistInfo(rank=0, world_size=world, backend="gloo"), **sizes)


def test_unknown_dimension_names_the_ones_that_exist():
    with pytest.raises(KeyError, match="'pp'"):
        Grid(DistInfo(), dp=1).group("pp")


def _check_world(facts: list[dict], world: int, sizes: dict) -> None:
    layout = grid_layout(sizes)
    for rank, f in enumerate(facts):
        assert layout[tuple(f["coords"].values())].item() == rank  # coords point back at the rank
        for name in sizes:
            members = f["ranks_in"][name]
            assert members == f["group_ranks"][name]  # the grid agrees with the process group
            assert len(members) == sizes[name] and rank in members
            others = {
                k: v for k, v in f["coords"].items() if k != name
            }  # members differ only along `name`
            assert all({k: facts[m]["coords"][k] for k in others} == others for m in members)
            assert f["sums"][name] == sum(members)  # a collective really ran in that group
    assert facts[0]["describe"][0].endswith(f"= {world} ranks")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world, sizes", CASES)
def test_every_rank_gets_its_coordinates_and_groups(world, sizes, tmp_path):
    _check_world(run_world(grid_facts, world, tmp_path, sizes, timeout_s=90), world, sizes)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_eight_ranks_as_dp_pp_tp_2x2x2(tmp_path):
    sizes = {"dp": 2, "pp": 2, "tp": 2}
    facts = run_world(grid_facts, 8, tmp_path, sizes, timeout_s=150)
    _check_world(facts, 8, sizes)
    assert facts[5]["coords"] == {"dp": 1, "pp": 0, "tp": 1}
    assert facts[5]["ranks_in"] == {"dp": [1, 5], "pp": [5, 7], "tp": [4, 5]}
