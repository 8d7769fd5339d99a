"""Unit and property tests of common/: setup choices, sampler contract, metric reduction, checkpoints, data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

from common.data import digits_split, load_digits, synthetic_images
from common.harness import env as cd
from common.harness.atomic import atomic_write, load_checkpoint, save_checkpoint
from common.harness.env import DistInfo, LessonError, choose_backend_and_device, read_torchrun_env
from common.harness.metrics import is_padding
from common.models import DigitsCNN, mlp
from tests._workers import accuracy_4_3_3, eval_ten_samples, param_diff, run_world

# ---- torchrun environment, backend and device ----------------------------------------------------------------


def test_plain_python_run_is_a_world_of_one():
    assert read_torchrun_env({}) == (0, 0, 1, 1)


def test_second_node_rank_differs_from_local_rank():
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert read_torchrun_env(env) == (3, 1, 4, 2)


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "4", "WORLD_SIZE": "4"},
        {"RANK": "0"},
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
    ],
)
def test_inconsistent_torchrun_environment_is_rejected(env):
    with pytest.raises(LessonError):
        read_torchrun_env(env)


def test_cpu_only_machine_gets_gloo_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_backend_and_device("auto", "auto", 1, 2) == ("gloo", torch.device("cpu"))


def _fake_gpus(monkeypatch, n):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(cd.dist, "is_nccl_available", lambda: True)


def test_device_index_is_local_rank_on_a_second_node(monkeypatch):
    # global rank 3 on a node with 2 GPUs: the GPU is cuda:1 (LOCAL_RANK), not cuda:3 (RANK)
    _fake_gpus(monkeypatch, 2)
    rank, local_rank, world, local_world = read_torchrun_env(
        {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    )
    assert choose_backend_and_device("auto", "auto", local_rank, local_world) == (
        "nccl",
        torch.device("cuda:1"),
    )


def test_too_few_gpus_falls_back_to_cpu_or_errors_when_cuda_is_forced(monkeypatch):
    _fake_gpus(monkeypatch, 1)
    assert choose_backend_and_device("auto", "auto", 1, 2) == ("gloo", torch.device("cpu"))
    with pytest.raises(LessonError, match="LOCAL_RANK 1"):
        choose_backend_and_device("auto", "cuda", 1, 2)


def test_gloo_cannot_carry_cuda_tensors(monkeypatch):
    _fake_gpus(monkeypatch, 2)
    with pytest.raises(LessonError, match="gloo's send/recv cannot move CUDA tensors"):
        choose_backend_and_device("gloo", "cuda", 0, 2)
    assert choose_backend_and_device("gloo", "auto", 0, 2) == ("gloo", torch.device("cpu"))


@pytest.mark.parametrize("backend, device", [("nccl", "auto"), ("auto", "cuda"), ("nccl", "cpu")])
def test_impossible_requests_on_cpu_only_machine(monkeypatch, backend, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LessonError):
        choose_backend_and_device(backend, device, 0, 1)


# ---- DistributedSampler contract (the sampler every lesson relies on) -----------------------------------------


@given(
    n=st.integers(1, 200),
    world=st.integers(1, 8),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    epoch=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_distributed_sampler_contract(n, world, shuffle, drop_last, epoch, seed):
    data = range(n)
    samplers = [
        DistributedSampler(
            data, num_replicas=world, rank=r, shuffle=shuffle, drop_last=drop_last, seed=seed
        )
        for r in range(world)
    ]
    for s in samplers:
        s.set_epoch(epoch)
    per_rank = [list(s) for s in samplers]
    lengths = {len(p) for p in per_rank}
    assert len(lengths) == 1  # equal lengths on every rank
    assert all(
        len(s) == len(p) for s, p in zip(samplers, per_rank)
    )  # len() is what iteration yields
    flat = [i for p in per_rank for i in p]
    assert all(0 <= i < n for i in flat)
    if drop_last:
        assert len(flat) == (n // world) * world and len(set(flat)) == len(
            flat
        )  # no overlap, tail dropped
    else:
        assert set(flat) == set(range(n))  # the union covers the dataset
        assert len(flat) - len(set(flat)) == len(flat) - n  # repeats are exactly the padding
        padding = sum(int(is_padding(n, world, r).sum()) for r in range(world))
        assert padding == len(flat) - n
    again = [
        DistributedSampler(
            data, num_replicas=world, rank=r, shuffle=shuffle, drop_last=drop_last, seed=seed
        )
        for r in range(world)
    ]
    for s in again:
        s.set_epoch(epoch)
    assert [list(s) for s in again] == per_rank  # same order when rerun


@given(n=st.integers(12, 200), world=st.integers(1, 4), epoch=st.integers(0, 5))
def test_set_epoch_gives_a_new_order(n, world, epoch):
    s = DistributedSampler(range(n), num_replicas=world, rank=0, shuffle=True, seed=0)
    s.set_epoch(epoch)
    before = list(s)
    s.set_epoch(epoch + 1)
    assert (
        list(s) != before
    )  # 12! orders: a collision is (practically) impossible, so this cannot be flaky


def test_ten_samples_over_three_ranks_padding_positions():
    # rank r reads positions r, r+3, r+6, r+9: positions 10 (rank 1) and 11 (rank 2) are padding
    assert [is_padding(10, 3, r).tolist() for r in range(3)] == [
        [False, False, False, False],
        [False, False, False, True],
        [False, False, False, True],
    ]


@pytest.mark.timeout(120)
def test_evaluation_counts_padded_duplicates_once(tmp_path):
    # 10 samples, 3 ranks: 4 indices each (12 positions, samples 0 and 1 repeated as padding). Only samples 0
    # and 1 are predicted right: the answer is 2/10 = 0.2, not the 4/12 a naive count of the padded shards gives.
    out = run_world(eval_ten_samples, 3, tmp_path)
    assert [len(o["indices"]) for o in out] == [4, 4, 4]
    for o in out:
        assert o["eval"]["accuracy"] == pytest.approx(0.2)
        assert o["eval"]["count"] == 10


@pytest.mark.timeout(120)
def test_accuracy_reduced_by_sum_and_count_not_by_mean_of_means(tmp_path):
    out = run_world(accuracy_4_3_3, 3, tmp_path)
    assert [o["global"] for o in out] == pytest.approx([0.4, 0.4, 0.4])
    assert np.mean([o["mean_of_means_part"] for o in out]) == pytest.approx(
        1 / 3
    )  # what averaging would say


@pytest.mark.timeout(120)
@pytest.mark.parametrize("perturb", [0.0, 0.25])
def test_param_check_detects_one_diverged_rank(tmp_path, perturb):
    out = run_world(param_diff, 2, tmp_path, perturb)
    assert out == pytest.approx([perturb, perturb])


# ---- checkpoints and results ------------------------------------------------------------------------------------


def test_checkpoint_roundtrip_and_atomic_failure_keeps_previous(tmp_path):
    path = tmp_path / "ckpt.pt"
    info = DistInfo()
    model = DigitsCNN()
    assert save_checkpoint({"model": model.state_dict(), "epoch": 1}, path, info)
    with pytest.raises(RuntimeError):

        def broken(f):
            f.write(b"partial")
            raise RuntimeError("crash while writing")

        atomic_write(path, broken)
    loaded = load_checkpoint(path)  # the previous checkpoint is intact
    assert loaded["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left behind
    for k, v in model.state_dict().items():
        assert torch.equal(loaded["model"][k], v)


def test_only_rank_zero_writes(tmp_path):
    assert not save_checkpoint(
        {"x": torch.ones(1)}, tmp_path / "a.pt", DistInfo(rank=1, world_size=2)
    )
    assert not (tmp_path / "a.pt").exists()


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(LessonError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "nope.pt")


# ---- data and models ---------------------------------------------------------------------------------------------


def test_bundled_digits_and_stratified_split():
    x, y = load_digits()
    assert x.shape == (1797, 1, 8, 8) and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1
    assert torch.bincount(y).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    train, test = digits_split()
    assert (len(train), len(test)) == (1438, 359)
    test_counts = torch.bincount(test.tensors[1], minlength=10).float()
    assert (
        test_counts / torch.bincount(y).float() - 0.2
    ).abs().max() < 0.01  # every class split 80/20
    train2, test2 = digits_split()
    assert torch.equal(
        test.tensors[0], test2.tensors[0]
    )  # identical on every call (and so on every rank)


def test_missing_or_foreign_data_file(tmp_path):
    with pytest.raises(LessonError, match="data file not found"):
        load_digits(tmp_path / "missing.npz")
    (tmp_path / "bad.npz").write_bytes(b"not an npz")
    with pytest.raises(LessonError, match="cannot read"):
        load_digits(tmp_path / "bad.npz")


def test_synthetic_images_are_learnable_shapes():
    ds = synthetic_images(64, image_size=16, channels=3, seed=1)
    x, y = ds.tensors
    assert x.shape == (64, 3, 16, 16) and y.shape == (64,) and int(y.max()) < 10
    assert torch.equal(x, synthetic_images(64, image_size=16, channels=3, seed=1).tensors[0])
    with pytest.raises(LessonError):
        synthetic_images(0)


def test_models_shapes():
    assert DigitsCNN()(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    assert DigitsCNN(in_channels=3, image_size=16)(torch.randn(2, 3, 16, 16)).shape == (2, 10)
    assert mlp([64, 32, 10])(torch.randn(4, 64)).shape == (4, 10)
    with pytest.raises(ValueError):
        mlp([8])
