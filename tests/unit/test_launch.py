"""common.run.launch and common.run.processes: the argv a multi-node launch gets, and the environment a launched process sees."""

from __future__ import annotations

from common.run.launch import torchrun_command
from common.run.processes import launch_env


def _rdzv_id(cmd: list[str]) -> str:
    ids = [a.split("=", 1)[1] for a in cmd if a.startswith("--rdzv-id=")]
    assert len(ids) == 1, cmd
    return ids[0]


def test_each_multi_node_command_gets_its_own_rendezvous_id():
    """A fixed id lets a second job on the same endpoint join the first (lesson 12, second_job_joins_first)."""
    a, b = (
        torchrun_command("03_ddp", 2, [], nnodes=2, rdzv_endpoint="127.0.0.1:29400")
        for _ in range(2)
    )
    assert _rdzv_id(a) != _rdzv_id(b)
    assert [x for x in a if not x.startswith("--rdzv-id=")] == [
        x for x in b if not x.startswith("--rdzv-id=")
    ]


def test_standalone_command_has_no_rendezvous_id():
    cmd = torchrun_command("03_ddp", 2, ["--epochs", "1"])
    assert "--standalone" in cmd and not any(a.startswith("--rdzv") for a in cmd)


def test_env_sets_one_thread_and_none_removes_a_variable(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert launch_env(None)["OMP_NUM_THREADS"] == "1"
    assert launch_env({"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS" not in launch_env(
        {"OMP_NUM_THREADS": None}
    )  # as in a fresh shell (mp.spawn exhibit)
