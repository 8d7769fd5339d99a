"""ZeRO by hand (common/sharding/zero.py), its accounting (common/sharding/accounting.py) and the completion marker of sharded
checkpoints (common/checkpoint/sharded.py): stages equal one process, bytes as the formulas, one clear error;
with frozen and tied parameters, lesson 02's step and every stage equal DDP + torch.optim, frozen ones untouched."""

from __future__ import annotations

import json
import math

import pytest
import torch

from common.checkpoint.sharded import MARKER, check_complete
from common.checkpoint.train_state import model_signature
from common.harness.env import LessonError
from common.measure.differences import relative_difference
from common.measure.memory import held_bytes
from common.models import ResidualMLP
from common.sharding.accounting import activation_bytes, moved_bytes
from common.sharding.zero import ZeRO, check_stages, check_world_size
from tests._13_workers import stages_vs_one_process
from tests._rank_workers import (
    FrozenTied,
    lesson02_step_vs_ddp,
    load_full_from_rank0_into_meta,
    save_over_a_finished_checkpoint,
    zero_vs_ddp,
)
from tests._workers import run_world


def test_a_world_of_one_is_plain_adam_and_the_parameters_view_one_flat_buffer():
    torch.manual_seed(0)
    model, ref = ResidualMLP(5, 1), ResidualMLP(5, 1)
    ref.load_state_dict(model.state_dict())
    zero = ZeRO(model, [model.stem, *model.blocks, model.head], 3, group=None, lr=1e-2)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    x, y = torch.randn(6, 64), torch.randint(10, (6,))
    for m, step in ((model, zero.step), (ref, opt.step)):
        for _ in range(2):
            torch.nn.functional.cross_entropy(m(x), y).backward()
            step()
            m.zero_grad()
    assert (
        max((a - b).abs().max().item() for a, b in zip(zero.full_parameters(), ref.parameters()))
        == 0.0
    )
    head = zero.units[-1]
    assert head.numel == head.padded == 60  # N = 1: no padding
    head.gather()
    assert (
        model.head[1].weight.untyped_storage().data_ptr() == head.flat.untyped_storage().data_ptr()
    )


def test_held_bytes_counts_each_storage_once_and_moved_bytes_follow_the_ring():
    flat = torch.zeros(10)
    assert (
        held_bytes([flat[:5], flat[5:], flat], [None], torch.optim.SGD([torch.nn.Parameter(flat)]))[
            "parameters"
        ]
        == 40
    )
    assert moved_bytes({"all_reduce": 100}, 4) == 150  # 2 Psi (N-1)/N
    assert (
        moved_bytes({"all_gather_single": 100, "reduce_scatter_single": 100}, 4) == 150
    )  # the same volume
    assert (
        moved_bytes({"all_gather_single": 200, "reduce_scatter_single": 100}, 2) == 150
    )  # stage 3: 1.5x


def test_relative_difference_is_a_fraction_of_the_change_and_fails_on_nan():
    start, b = [torch.zeros(4)], [torch.full((4,), 2.0)]  # training moved ||b - start|| = 4
    assert relative_difference([torch.tensor([2.0, 2.0, 2.0, 2.4])], b, start) == pytest.approx(0.1)
    assert relative_difference(b, b, start) == 0.0
    assert (
        relative_difference(b, b, b) == 0.0 and relative_difference(start, b, b) == math.inf
    )  # nothing moved
    for bad in (math.nan, math.inf):  # a NaN or inf anywhere: no `<=` bound can hold
        value = relative_difference([torch.tensor([2.0, 2.0, 2.0, bad])], b, start)
        assert not value <= 1e-3


def test_activation_bytes_at_the_end_of_forward_exclude_parameters_and_freed_weights():
    torch.manual_seed(0)
    plain = ResidualMLP(5, 1)
    x = torch.randn(6, 64)
    expected = activation_bytes(plain, x)
    assert expected > 0
    model = ResidualMLP(5, 1)
    ZeRO(
        model, [model.stem, *model.blocks, model.head], 3, group=None, lr=1e-2
    )  # frees weights after forward
    assert activation_bytes(model, x) == expected
    held = torch.nn.Linear(64, 5)
    frozen_copy = (
        held.weight.detach().clone().requires_grad_()
    )  # a weight that is not one of its parameters

    class Twin(torch.nn.Module):
        def forward(self, t):
            return t @ frozen_copy.t()

    x = torch.randn(
        6, 64, requires_grad=True
    )  # mm saves both: x for the weight's grad, the weight for x's
    assert activation_bytes(Twin(), x) == (x.numel() + frozen_copy.numel()) * 4


@pytest.mark.timeout(120)
def test_every_stage_equals_one_process_on_2_ranks_and_moves_the_formula_bytes(tmp_path):
    out = run_world(stages_vs_one_process, 2, tmp_path, timeout_s=100)
    numel = out[0][
        "numel"
    ]  # stem 325 + block 60 + head 60 = 445: 2 divides neither the total nor the stem
    for stage in (1, 2, 3):
        r = out[0][stage]
        assert all(o[stage]["diff"] <= 1e-6 for o in out), [o[stage]["diff"] for o in out]
        assert all(o[stage]["padding_zero"] for o in out)
        padded = sum(r["padded"])
        assert padded == numel + 1 and all(p % 2 == 0 for p in r["padded"])
        gathers = 2 if stage == 3 else 1  # stage 3 gathers before forward and again before backward
        assert r["calls"] == {
            "all_gather_single": 3 * gathers,
            "reduce_scatter_single": 3,
        }  # 3 units, 1 step
        assert r["bytes"] == {
            "all_gather_single": 4 * padded * gathers,
            "reduce_scatter_single": 4 * padded,
        }
        assert (
            r["state_bytes"] == 2 * 4 * padded // 2 + 4 * 3
        )  # exp_avg, exp_avg_sq of 1/N; 3 step counters
        full_grads = r["grad_bytes_after_backward"] == 4 * numel
        assert full_grads == (
            stage == 1
        )  # stage 1 ends backward with all gradients, 2 and 3 with 1/N
        if stage > 1:
            assert r["grad_bytes_after_backward"] == 4 * padded // 2
        assert (r["flat_bytes_at_rest"] == 0) == (
            stage == 3
        )  # stage 3 frees the full parameters between uses


@pytest.mark.parametrize("text", ["0", "1,4", "2,x", ""])
def test_a_stage_that_does_not_exist_is_one_clear_error(text):
    with pytest.raises(LessonError, match="stages"):
        check_stages(text)
    assert check_stages("3,1,1") == [1, 3]


def test_a_world_that_leaves_a_rank_only_padding_is_refused():
    check_world_size({"block": 4}, 2)
    with pytest.raises(LessonError, match="world size 3 cannot split unit 'block'"):
        check_world_size({"block": 4}, 3)  # shards of 2: ranks 0 and 1 own all four elements
    assert all(
        n - (w - 1) * math.ceil(n / w) > 0 for n in (6973, 340) for w in (2, 4)
    )  # the lesson's sizes


def test_a_checkpoint_without_its_marker_or_of_another_model_is_refused(tmp_path):
    sig = model_signature(ResidualMLP(5, 1))
    with pytest.raises(LessonError, match="not a folder"):
        check_complete(tmp_path / "absent", sig)
    (tmp_path / ".metadata").write_bytes(b"written before a crash")
    with pytest.raises(LessonError, match="no COMPLETE.json: its save did not finish"):
        check_complete(tmp_path, sig)
    (tmp_path / MARKER).write_text("{not json")
    with pytest.raises(LessonError, match="not a completion marker"):
        check_complete(tmp_path, sig)
    (tmp_path / MARKER).write_text(
        json.dumps({"model": model_signature(ResidualMLP(6, 1)), "world_size": 4})
    )
    with pytest.raises(
        LessonError, match=r"another model: stem.weight is \[6, 64\] there, \[5, 64\] here"
    ):
        check_complete(tmp_path, sig)
    (tmp_path / MARKER).write_text(json.dumps({"model": sig, "world_size": 4}))
    assert check_complete(tmp_path, sig)["world_size"] == 4


# ---- frozen (requires_grad=False) and tied (shared) parameters, as fine-tuning has them --------------------------


def _check_frozen_and_tied(r: dict) -> None:
    assert r["frozen"] == ["stem.weight", "stem.bias", "block.0.bias"] and r["still_tied"]
    assert (
        r["frozen_vs_start"] == 0.0 and r["frozen_vs_ddp"] == 0.0
    )  # untouched: no weight decay, no update
    assert r["trainable_vs_ddp"] <= 1e-6, r  # float32, another summation order; NaN fails here
    assert (
        r["trainable_moved"] > 1e-3
    )  # the comparison is not between two models that never trained


@pytest.mark.timeout(120)
def test_lesson02_step_equals_ddp_with_frozen_and_tied_parameters(tmp_path):
    out = run_world(lesson02_step_vs_ddp, 2, tmp_path, timeout_s=100)
    for r in out:
        _check_frozen_and_tied(r)


@pytest.mark.timeout(120)
def test_every_stage_equals_ddp_with_frozen_and_tied_parameters(tmp_path):
    out = run_world(zero_vs_ddp, 2, tmp_path, timeout_s=100)
    for rank_out in out:
        for stage in (1, 2, 3):
            r = rank_out[stage]
            _check_frozen_and_tied(
                r
            )  # rank 1 started elsewhere: the wrap broadcast rank 0's, frozen ones too
            assert r["units"] == 2 and r["padding_zero"]  # the all-frozen stem has no flat buffer


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_world_of_one_with_frozen_parameters_is_plain_adamw(stage):
    torch.manual_seed(0)
    model, ref = FrozenTied(), FrozenTied()
    ref.load_state_dict(model.state_dict())
    zero = ZeRO(
        model,
        [model.stem, model.block, model.head],
        stage,
        optimizer_cls=torch.optim.AdamW,
        lr=1e-2,
        weight_decay=0.1,
    )
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = torch.randn(6, 64), torch.randint(10, (6,))
    for m, step in ((model, zero.step), (ref, opt.step)):
        for _ in range(2):
            torch.nn.functional.cross_entropy(m(x), y).backward()
            step()
            m.zero_grad(set_to_none=True)
    params = zero.full_parameters()
    assert (
        torch.stack([(a - b).abs().max() for a, b in zip(params, ref.parameters())]).max().item()
        <= 1e-7
    )
    assert torch.equal(params[0], ref.stem.weight) and torch.equal(
        model.block[0].bias, ref.block[0].bias
    )


def test_a_parameter_tied_across_two_units_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = model[
        0
    ].weight  # one parameter in two units: stage 3 would free it under the other's use
    with pytest.raises(LessonError, match="tied between two modules too: put both in one unit"):
        ZeRO(model, [model[0], model[1]], 1)
    ZeRO(model, [model], 3)  # in one unit it is one parameter of the flat buffer


@pytest.mark.timeout(120)
def test_a_save_stopped_before_its_marker_is_refused_even_over_a_finished_checkpoint(tmp_path):
    out = run_world(
        save_over_a_finished_checkpoint, 2, tmp_path, str(tmp_path / "ck"), timeout_s=100
    )
    for r in out:
        assert r["first"] == 1  # the first save finished: its marker vouches for it
        assert "has no COMPLETE.json: its save did not finish" in r["second"], (
            r
        )  # the old marker was removed


@pytest.mark.timeout(120)
def test_lesson13_meta_model_loads_the_full_state_dict_broadcast_from_rank0(tmp_path):
    """The recipe lesson 13's Run.fresh names: StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)."""
    out = run_world(load_full_from_rank0_into_meta, 2, tmp_path, timeout_s=100)
    for r in out:
        assert "full_state_dict must be True when broadcast_from_rank0 is True" in r["refused"], r
        assert r["keys"] and r["worst"] == 0.0, r  # NaN (garbage from to_empty) fails here too
