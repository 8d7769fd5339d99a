"""Which restart attempt this is, agreed by every node, and the store its process group meets in (lessons 03-17).

torchrun --max-restarts=N stops and restarts EVERY worker of the job when one fails, on every node, and all
attempts share one key-value store (torchrun's, TORCHELASTIC_USE_AGENT_STORE=True). A restarted process group
must not read the keys a dead attempt left there (pytorch/pytorch#135712: a gloo rank reads a dead peer's
address and hangs in init), so each attempt meets under a prefix of its own: `lessons/attempt_<n>/`.

Why n is not TORCHELASTIC_RESTART_COUNT (pytorch/pytorch#108158): that variable is max_restarts minus the restarts
THIS NODE's agent has left, and an agent counts a restart only when its own workers failed. In torch 2.13's
`SimpleElasticAgent._invoke_run` (torch/distributed/elastic/agent/server/api.py) a FAILED worker group takes
`self._remaining_restarts -= 1; self._restart_workers(...)`, while a HEALTHY one that sees another node waiting
(`rdzv_handler.num_nodes_waiting() > 0`) calls `_restart_workers` without counting ("membership changes do not
count as retries"). A hung rank is alive, so its node restarts uncounted: after one restart the nodes disagree
(1 and 0) and the ranks meet under different prefixes until the store times out. Even a crash is a race: the
peer node counts only if its workers fail before its agent polls the rendezvous.

What every node does agree on: each restart is a new rendezvous ROUND (dynamic_rendezvous.py: an agent that
restarts leaves the round and joins the next; with a fixed --nnodes the round completes only when every node
has joined, so every worker of the old attempt is stopped before any worker of the new one starts), and a
round starts exactly one global rank 0. The round number is not given to workers, so `agree_attempt` counts rank-0 starts in the shared
store and hands that count to the other ranks with a handshake that a dead attempt's leftovers cannot fool.
With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 every attempt gets a fresh store (rank 0 hosts it): no leftovers to
hide from, and no memory of earlier attempts either, so the attempt falls back to TORCHELASTIC_RESTART_COUNT.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch.distributed as dist

from common.harness.env import LessonError

__all__ = ["job_store", "agree_attempt", "attempt", "attempt_if_known", "rendezvous_store"]

_AGREED: list[
    int
] = []  # this process's attempt, once agreed (a process belongs to exactly one attempt)


def _shared() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def job_store(wait_s: float = 300.0) -> dist.Store:
    """A client of torchrun's store (or, when it is not shared, rank 0 hosts this attempt's own).

    Its timeout bounds the rendezvous: ranks that finish importing torch seconds apart must still meet, so it is
    `wait_s`, not --timeout-s (which bounds collectives, and may be 1 s in a lesson's failure demo).
    """
    env = os.environ
    return dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        int(env["WORLD_SIZE"]),
        is_master=not _shared() and env["RANK"] == "0",
        timeout=timedelta(seconds=wait_s),
        multi_tenant=not _shared(),
    )


def agree_attempt(
    store: dist.Store, rank: int, world_size: int, wait_s: float = 300.0, poll_s: float = 0.5
) -> int:
    """0 for the job's first attempt, then 1, 2, ...: the same number on every rank of an attempt.

    1. Every process counts itself under its rank: `mine` = how many processes of this rank have started in
       this job, a number no earlier process of this rank had.
    2. Rank 0 (one per attempt) proposes its `mine` under a fixed key, then waits for each rank's answer
       under `ack/<proposal>/<rank>` (a fresh key: no earlier rank 0 had this proposal) and confirms it under
       `confirm/<proposal>/<rank>/<that rank's mine>`.
    3. Every other rank reads the proposal, answers it, and waits `poll_s` for the confirmation. A proposal
       left by a dead rank 0 is never confirmed (and no old confirmation can carry this process's fresh
       `mine`), so the rank reads the proposal again until the live rank 0's is confirmed.
    """
    mine = store.add(f"lessons/starts/rank_{rank}", 1)
    if rank == 0:
        store.set("lessons/proposal", str(mine))
        for r in range(1, world_size):
            ack = f"lessons/ack/{mine}/{r}"
            store.wait([ack])  # bounded by the store's timeout (`wait_s` in `job_store`)
            store.set(f"lessons/confirm/{mine}/{r}/{store.get(ack).decode()}", "1")
        return mine - 1
    deadline = time.monotonic() + wait_s
    while True:
        proposal = store.get(
            "lessons/proposal"
        ).decode()  # waits for a first rank 0, maybe a dead one
        store.set(f"lessons/ack/{proposal}/{rank}", str(mine))
        try:
            store.wait([f"lessons/confirm/{proposal}/{rank}/{mine}"], timedelta(seconds=poll_s))
            return int(proposal) - 1
        except dist.DistStoreError:
            if time.monotonic() > deadline:
                raise LessonError(
                    f"rank {rank}: no rank 0 confirmed this restart attempt in {wait_s:.0f} s"
                ) from None


def attempt(wait_s: float = 300.0) -> int:
    """This process's restart attempt (0 first), agreed by every node; 0 without torchrun. Cached."""
    if not _AGREED:
        env = os.environ
        if "RANK" not in env:
            _AGREED.append(0)
        elif not _shared():
            _AGREED.append(int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))
        else:
            _AGREED.append(
                agree_attempt(job_store(wait_s), int(env["RANK"]), int(env["WORLD_SIZE"]), wait_s)
            )
    return _AGREED[0]


def attempt_if_known() -> str:
    """The agreed attempt if this process has one yet, else this node's TORCHELASTIC_RESTART_COUNT (a label
    for keys written before the agreement, e.g. while every rank reports the same bad option)."""
    return str(_AGREED[0]) if _AGREED else os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def rendezvous_store(wait_s: float = 300.0) -> dist.Store:
    """The store this attempt's process group meets in: torchrun's, under `lessons/attempt_<attempt()>/`."""
    return dist.PrefixStore(f"lessons/attempt_{attempt(wait_s)}", job_store(wait_s))
