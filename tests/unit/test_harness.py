"""The harness through the paths lessons use: atomic save_checkpoint, evaluate's mode and empty data, rank0_only."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from common.harness import atomic as checkpoint
from common.harness.atomic import load_checkpoint, save_checkpoint
from common.harness.env import DistInfo, LessonError
from common.harness.metrics import evaluate
from tests._workers import rank0_phase, run_world


def test_save_checkpoint_that_fails_half_way_keeps_the_previous_one(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"epoch": torch.tensor(1)}, path, DistInfo())

    def crash_half_way(obj, f):  # torch.save writing some bytes, then the process "dies"
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", crash_half_way)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint({"epoch": torch.tensor(2)}, path, DistInfo())
    monkeypatch.undo()
    assert load_checkpoint(path)["epoch"].item() == 1  # the previous checkpoint still loads
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # and no temporary file is left


@pytest.mark.parametrize("training", [True, False])
def test_evaluate_restores_the_mode_it_found(training):
    model = nn.Sequential(nn.Linear(2, 3), nn.Dropout(0.5))
    model.train(training)
    data = TensorDataset(torch.randn(5, 2), torch.zeros(5, dtype=torch.long))
    out = evaluate(model, data, DistInfo())
    assert out["count"] == 5
    assert model.training is training and model[1].training is training


def test_evaluate_on_an_empty_dataset_is_a_clear_error():
    empty = TensorDataset(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long))
    with pytest.raises(LessonError, match="empty"):
        evaluate(nn.Linear(2, 3), empty, DistInfo())


@pytest.mark.timeout(120)
def test_rank0_only_phase_is_not_bounded_by_the_collective_timeout(tmp_path):
    assert run_world(rank0_phase, 2, tmp_path, "rank0_only", timeout_s=90) == [2.0, 2.0]
    (tmp_path / "plain").mkdir()
    plain = run_world(rank0_phase, 2, tmp_path / "plain", "barrier", timeout_s=90)
    assert plain[1] != "no error"  # the old way: the waiting rank times out


@pytest.mark.timeout(60)
def test_each_restart_attempt_meets_under_its_own_prefix(monkeypatch):
    """torchrun shares one store across restarts; keys a dead attempt left must be invisible to the next."""
    from datetime import timedelta

    import torch.distributed as dist

    from common.harness.rendezvous import rendezvous_store
    from tests._workers import free_port

    port = free_port()
    agent = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False
    )  # torchrun's
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    from common.harness import rendezvous

    monkeypatch.setattr(
        rendezvous, "_AGREED", [0]
    )  # the attempt every node agreed on (test_session.py)
    rendezvous_store().set("rank_0_address", "dead peer")
    monkeypatch.setattr(rendezvous, "_AGREED", [1])
    second = rendezvous_store()
    assert not second.check(["rank_0_address"])  # the dead attempt's key is not seen
    assert agent.get("lessons/attempt_0/rank_0_address") == b"dead peer"
