"""How a lesson's process ends: the exit status a claim that does not hold leaves, one thread per process unless
told, an exit that skips interpreter finalization, and waiting for peers that are failing."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from common.harness.rendezvous import attempt_if_known

__all__ = [
    "exit_process",
    "exit_status",
    "one_thread_unless_told",
    "set_exit_status",
    "wait_for_failing_peers",
]


_exit_status = (
    0  # what run_main ends the process with when main returns: 1 after a claim that does not hold
)


def set_exit_status(code: int) -> None:
    """The status `run_main` ends the process with when `main` returns normally (`Report.finish` sets 1 when a
    claim does not hold): main still returns, so `distributed_session` destroys the process group first."""
    global _exit_status
    _exit_status = code


def exit_status() -> int:
    """The status `set_exit_status` left: 0 unless a claim did not hold."""
    return _exit_status


def one_thread_unless_told() -> None:
    """One compute thread per process when OMP_NUM_THREADS is unset, as under torchrun and in the notebooks.

    torchrun sets OMP_NUM_THREADS=1 for nproc_per_node > 1 and the notebooks launch with it; a plain `python
    lessons/NN_x.py` would otherwise start one thread per core. Measured on the 2-core machine: lesson 01 ran
    2.3x slower with 2 threads beside other work, and its printed losses differed in the last digits from the
    notebook's (a sum split over threads adds in another order). Processes this one starts (mp.spawn) inherit
    the variable. Set OMP_NUM_THREADS yourself to choose another count; rank 0 says so in one line.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if os.environ.get("RANK", "0") == "0":
        print(
            "note: OMP_NUM_THREADS is unset: 1 compute thread per process, as torchrun and the notebooks use "
            "(set it to choose)",
            flush=True,
        )


def exit_process(code: int = 0) -> None:
    """Flush stdout and stderr and end the process at once with `code` (`os._exit`): see `run_main` for why."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def wait_for_failing_peers(timeout_s: float = 10.0) -> None:
    """Under torchrun, wait (at most `timeout_s`) until every rank has reported an error, then return.

    torchrun terminates all workers as soon as one exits non-zero. A rank that is still importing torch when
    its peer fails would be killed before printing its own error line. So each failing rank counts itself in
    torchrun's key-value store (the agent's TCPStore, TORCHELASTIC_USE_AGENT_STORE=True, which exists before any
    process group) and leaves when all WORLD_SIZE ranks have counted themselves, or when the time is up.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size < 2 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    try:
        import time

        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )
        key = f"lessons/failed_ranks/{attempt_if_known()}"
        store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while store.add(key, 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # no store to reach: exit at once rather than fail differently
        return
