"""Lesson 12's exhibits of two jobs on one rendezvous endpoint: real torchrun agents on loopback, on rank 0.

Each job is a torchrun agent running `common.exhibits.worker env` (no torch import, so a launch costs only the
agent); every wait has a timeout, and both agents are stopped with their process groups afterwards.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from common.exhibits.frame import Ctx, exhibit, first_line
from common.exhibits.launchers import TORCHRUN, WORKER
from common.harness.spawn import free_port
from common.run.processes import REPO_ROOT


def _start(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*TORCHRUN, *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        cwd=REPO_ROOT,
        env=env,
        start_new_session=True,
    )


def _wait_for(log: Path, text: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in log.read_text():
            return True
        time.sleep(0.1)
    return False


def _stop(*procs: subprocess.Popen) -> None:
    """SIGTERM each agent (torchrun then stops its workers, which run in sessions of their own), SIGKILL 5 s
    later (an agent blocked in a rendezvous does not answer SIGTERM; its `env` worker ends by itself)."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _same_endpoint(port: int, rdzv_id: str, nnodes: str = "1") -> list[str]:
    return [
        f"--nnodes={nnodes}",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={rdzv_id}",
        "--rdzv-conf=last_call_timeout=1",
        "--monitor-interval=0.2",
    ]


def _two_jobs(
    args_a: list[str], args_b: list[str], b_s: float, wait_for: str = "", then_s: float = 3.0
) -> list[str]:
    """Job A, then job B (its worker sleeps b_s) once A's worker runs.

    With `wait_for`, wait until A's log shows it; otherwise wait until B's worker runs, then let A's worker
    end (a normal exit). Then wait at most then_s for B to end, stop both, and return their logs, B's with its
    exit code (None: still running). Every wait has a timeout.
    """
    with tempfile.TemporaryDirectory() as tmp:
        log_a, log_b, release = Path(tmp) / "a.log", Path(tmp) / "b.log", Path(tmp) / "a_may_end"
        a = _start([*args_a, *WORKER, "env", "A", f"until:{release}"], log_a)
        _wait_for(log_a, "A RANK=0", 30)
        b = _start([*args_b, *WORKER, "env", "B", str(b_s)], log_b)
        if wait_for:
            _wait_for(log_a, wait_for, 30)
        else:
            _wait_for(log_b, "B RANK=", 30)
            release.touch()
            try:
                a.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            code_b = b.wait(timeout=then_s)
        except subprocess.TimeoutExpired:
            code_b = None
        release.touch()  # a worker still running ends by itself
        _stop(a, b)
        return [log_a.read_text(), log_b.read_text() + f"\nexit code of B: {code_b}"]


@exhibit(
    "second_job_joins_first",
    "launch",
    lesson="03",
    symptom="Sending process PID closing signal SIGTERM",
    cause="two jobs with the same --rdzv-endpoint and --rdzv-id form "
    "one rendezvous: with --nnodes=MIN:MAX the second one joins, "
    "and the first one's agent stops its workers to admit it",
    when="in torchrun's log of a running job when another job starts (its worker is stopped)",
    fix="a unique --rdzv-id per job ($SLURM_JOB_ID)",
)
def second_job_joins_first(ctx: Ctx) -> None:
    with ctx.rank0("two jobs with one rendezvous") as mine:
        if not mine:
            return
        port = free_port()
        same = _same_endpoint(port, "myjob", "1:2")
        text_a, text_b = _two_jobs(same, same, 60, wait_for="closing signal SIGTERM", then_s=0.5)
        killed = first_line(
            text_a, "closing signal SIGTERM", limit=1000
        )  # whole: the prefix varies
        ctx.step(
            "symptom",
            "job A runs (--nnodes=1:2); job B starts with the same endpoint and --rdzv-id:",
        )
        ctx.say(f"    job A: {first_line(text_a, 'A RANK=0').split(' TORCHELASTIC_RUN_ID')[0]}")
        agent_line = re.sub(
            r"process \d+", "process PID", re.sub(r".*] ", "", killed)
        )  # the PID varies
        ctx.say(f"    job A's agent: {agent_line}")
        ctx.record("symptom", agent_line)  # the message alone, without the log's time and path
        ctx.claim(
            "broken_first_job_killed",
            int("A RANK=0" in text_a and bool(killed)),
            "==",
            1,
            "job A's running worker was stopped when job B arrived: {value}",
        )
        ctx.step(
            "diagnosis",
            "TORCHELASTIC_RUN_ID is the same in both jobs; LOGLEVEL=INFO shows A's agent "
            "detecting the new node",
        )
        port = free_port()
        args_a, args_b = _same_endpoint(port, "jobA", "1:2"), _same_endpoint(port, "jobB", "1:2")
        text_a, text_b = _two_jobs(args_a, args_b, 0, then_s=10)
        alone = [
            f"{j} RANK=0 LOCAL_RANK=0 WORLD_SIZE=1" in t for j, t in zip("AB", (text_a, text_b))
        ]
        ctx.record("fixed", {"alone": alone, "b": text_b[-200:]})
        ctx.step(
            "fix",
            "a unique --rdzv-id per job ($SLURM_JOB_ID): B runs alone and A's worker keeps running",
        )
        ctx.claim(
            "fixed_jobs_alone",
            sum(alone) if "closing signal" not in text_a else 0,
            "==",
            2,
            "jobs that ran alone, with job A's worker never stopped: {value}",
        )


@exhibit(
    "second_job_loses_store",
    "launch",
    lesson="03",
    symptom=(
        "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The "
        "connection to the C10d store has failed. See inner exception for details."
    ),
    cause="two jobs with the same --rdzv-endpoint (own --rdzv-ids): the first job's agent "
    "hosts the store both use, and takes it along when it exits (pytorch/pytorch#126510)",
    when="in job B, when job A ends",
    fix=("each job its own --rdzv-endpoint port (and --rdzv-id), or --standalone on one machine"),
)
def second_job_loses_store(ctx: Ctx) -> None:
    with ctx.rank0("two jobs on one endpoint") as mine:
        if not mine:
            return
        port = free_port()
        text_a, text_b = _two_jobs(
            _same_endpoint(port, "jobA"), _same_endpoint(port, "jobB"), 60, then_s=20
        )
        error = first_line(text_b, "RendezvousConnectionError: The connection")
        ctx.step(
            "symptom",
            "jobs A and B, own --rdzv-ids, one --rdzv-endpoint; B's worker runs, then A ends; B:",
        )
        ctx.say(f"    {error}")
        ctx.record("symptom", error)
        ctx.record("b_log_tail", text_b[-200:])
        ctx.claim(
            "broken_second_job_dies",
            int("B RANK=0" in text_b and bool(error) and "exit code of B: None" not in text_b),
            "==",
            1,
            "job B started, then died with RendezvousConnectionError when A ended: {value}",
        )
        ctx.step(
            "diagnosis",
            "B's traceback goes through the agent's "
            "num_nodes_waiting / keep-alive into the "
            "c10d store at A's --rdzv-endpoint",
        )
        text_a, text_b = _two_jobs(
            _same_endpoint(port, "jobA"), _same_endpoint(free_port(), "jobB"), 3, then_s=30
        )
        ctx.step(
            "fix",
            "each job its own --rdzv-endpoint port (and --rdzv-id), or --standalone on one machine",
        )
        ctx.claim(
            "fixed_second_job_finishes",
            int("exit code of B: 0" in text_b),
            "==",
            1,
            "job B, on its own port, outlived job A and exited 0: {value}",
        )
