"""Unit tests of common.harness.session: the device `setup` picks on every node, and the legacy launcher's --local-rank.

No process group is created: `init_process_group` and `torch.cuda.set_device` are faked, and so are 2 GPUs, so
that the CUDA branch runs on this CPU-only machine (a CPU run hides a device chosen from the wrong variable).
"""

from __future__ import annotations

import argparse
import importlib
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from common.harness import options, session


@pytest.fixture
def fake_two_gpu_node(monkeypatch):
    """2 visible GPUs, NCCL available; records set_device and init_process_group calls instead of making them."""
    calls = {"set_device": [], "init_process_group": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: calls["set_device"].append(torch.device(d))
    )
    monkeypatch.setattr(
        dist, "init_process_group", lambda **kw: calls["init_process_group"].append(kw)
    )
    monkeypatch.setattr(
        session, "rendezvous_store", lambda: "torchrun's store, this attempt's prefix"
    )
    return calls


def _torchrun_env(monkeypatch, rank, local_rank, world_size=4, local_world_size=2):
    monkeypatch.delenv(
        "TORCHELASTIC_MAX_RESTARTS", raising=False
    )  # a job torchrun will not restart
    monkeypatch.delenv(
        "TORCHELASTIC_MAX_RESTARTS", raising=False
    )  # a job torchrun will not restart
    env = dict(
        RANK=rank, LOCAL_RANK=local_rank, WORLD_SIZE=world_size, LOCAL_WORLD_SIZE=local_world_size
    )
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))


@pytest.mark.timeout(30)
def test_setup_on_a_second_node_uses_local_rank_for_the_device(fake_two_gpu_node, monkeypatch):
    """torchrun --nnodes=2 --nproc_per_node=2: global rank 3 is LOCAL_RANK 1 on node 1 -> cuda:1, not cuda:3."""
    _torchrun_env(monkeypatch, rank=3, local_rank=1)
    info = session.setup(timeout_s=5)
    assert info.device == torch.device("cuda:1")
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (3, 1, 4, 2)
    assert info.backend == "nccl" and not info.master_process
    assert fake_two_gpu_node["set_device"] == [
        torch.device("cuda:1")
    ]  # bound before the process group
    (kw,) = fake_two_gpu_node["init_process_group"]
    assert kw["backend"] == "nccl" and kw["device_id"] == torch.device("cuda:1")
    assert kw["timeout"].total_seconds() == 5
    assert set(kw) == {"backend", "timeout", "device_id"}  # env:// reads RANK and WORLD_SIZE itself


def test_a_restartable_job_meets_under_its_attempts_prefix(fake_two_gpu_node, monkeypatch):
    """torchrun --max-restarts=2: the process group meets in torchrun's store under this attempt's prefix."""
    _torchrun_env(monkeypatch, rank=3, local_rank=1)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    session.setup(timeout_s=5)
    (kw,) = fake_two_gpu_node["init_process_group"]
    assert (kw["rank"], kw["world_size"], kw["store"]) == (
        3,
        4,
        "torchrun's store, this attempt's prefix",
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rank, local_rank", [(0, 0), (1, 1), (2, 0), (3, 1)])
def test_every_rank_of_two_nodes_gets_its_local_gpu(
    fake_two_gpu_node, monkeypatch, rank, local_rank
):
    _torchrun_env(monkeypatch, rank=rank, local_rank=local_rank)
    info = session.setup()
    assert info.device == torch.device(f"cuda:{local_rank}") and info.master_process == (rank == 0)


@pytest.mark.timeout(30)
def test_setup_without_torchrun_creates_no_process_group(fake_two_gpu_node, monkeypatch):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    info = session.setup()
    assert (info.rank, info.world_size, info.device, info.backend) == (
        0,
        1,
        torch.device("cuda:0"),
        None,
    )
    assert fake_two_gpu_node["init_process_group"] == []


# ---- the legacy launcher: python -m torch.distributed.launch appends --local-rank=N ---------------------------


@pytest.mark.parametrize(
    "argv, value",
    [
        ([], None),
        (["--local-rank=1"], 1),
        (["--local-rank", "0"], 0),
        (["--local_rank=1"], 1),
        (["--local_rank", "3"], 3),
    ],
)
def test_add_distributed_args_accepts_the_legacy_local_rank(argv, value):
    args = session.add_distributed_args(argparse.ArgumentParser()).parse_args(argv)
    assert args.legacy_local_rank == value


def test_other_unknown_arguments_are_still_rejected():
    parser = session.add_distributed_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--local-ranks=1"])


@pytest.mark.parametrize(
    "lesson", ["03_ddp"]
)  # lesson 01 runs one process: no launcher, no --local-rank
def test_lessons_accept_the_legacy_local_rank(lesson, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    args = importlib.import_module(f"lessons.{lesson}").parse_args(
        ["--local-rank=1", "--epochs", "1"]
    )
    assert args.legacy_local_rank == 1 and args.epochs == 1


def test_legacy_note_is_printed_by_rank_zero_only(monkeypatch, capsys):
    args = argparse.Namespace(legacy_local_rank=1)
    monkeypatch.setenv("RANK", "1")
    options.legacy_launcher_note(args)
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    options.legacy_launcher_note(args)
    out = capsys.readouterr().out
    assert out.count("note: --local-rank") == 1 and "torchrun" in out
    options.legacy_launcher_note(argparse.Namespace(legacy_local_rank=None))  # torchrun: no note
    assert capsys.readouterr().out == ""


def test_distributed_session_prints_the_note_once(monkeypatch, capsys):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    args = session.add_distributed_args(argparse.ArgumentParser()).parse_args(
        ["--local-rank=0", "--device", "cpu"]
    )
    with session.distributed_session(args) as info:
        assert not info.distributed
    assert capsys.readouterr().out.count("note: --local-rank") == 1


# ---- restart attempts every node agrees on (common/harness/rendezvous.py, pytorch/pytorch#108158) ---------------------


def _agent_store():
    """torchrun's shared store (a TCPStore server the agent hosts; workers are clients)."""
    from tests._workers import free_port

    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=20), wait_for_workers=False
    )
    return server, lambda: dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20)
    )


def _attempt_of_every_rank(client, world_size: int, order: list[int]) -> list[int]:
    """One attempt: the ranks start in `order` (a non-zero rank first reads what a dead attempt left)."""
    from common.harness.rendezvous import agree_attempt

    with ThreadPoolExecutor(world_size) as pool:
        futures = {}
        for r in order:
            futures[r] = pool.submit(agree_attempt, client(), r, world_size, 20.0, 0.2)
            time.sleep(0.3)
        return [futures[r].result(timeout=30) for r in range(world_size)]


@pytest.mark.timeout(90)
def test_every_rank_agrees_on_the_attempt_whatever_a_dead_attempt_left():
    server, client = _agent_store()
    assert _attempt_of_every_rank(client, 3, [0, 1, 2]) == [0, 0, 0]
    assert _attempt_of_every_rank(client, 3, [2, 1, 0]) == [
        1,
        1,
        1,
    ]  # ranks 1, 2 see attempt 0's proposal first
    # an attempt killed during the handshake: rank 0 proposed, rank 2 answered, rank 1 never started
    c = client()
    c.add("lessons/starts/rank_0", 1)
    c.set("lessons/proposal", "3")
    c.add("lessons/starts/rank_2", 1)
    c.set("lessons/ack/3/2", "3")
    assert _attempt_of_every_rank(client, 3, [1, 2, 0]) == [
        3,
        3,
        3,
    ]  # not 2: the killed one had a rank 0 too
    # a node whose agent restarted its workers without counting (TORCHELASTIC_RESTART_COUNT 0 vs 1) agrees too
    assert _attempt_of_every_rank(client, 2, [1, 0]) == [4, 4]


@pytest.mark.timeout(30)
def test_attempt_is_zero_without_torchrun_and_the_prefix_carries_it(monkeypatch):
    from common.harness import rendezvous

    monkeypatch.setattr(rendezvous, "_AGREED", [])
    monkeypatch.delenv("RANK", raising=False)
    assert rendezvous.attempt() == 0 and rendezvous.attempt_if_known() == "0"
    server, _ = _agent_store()
    monkeypatch.setattr(rendezvous, "_AGREED", [2])
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for k, v in dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=server.port, WORLD_SIZE=2, RANK=1
    ).items():
        monkeypatch.setenv(k, str(v))
    rendezvous.rendezvous_store().set("rank_0_address", "this attempt's peer")
    assert server.get("lessons/attempt_2/rank_0_address") == b"this attempt's peer"
