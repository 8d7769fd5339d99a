"""Scripts that lesson 12's exhibits launch as processes: `python -m common.exhibits.worker MODE ...`.

Each mode is a few lines a user could have written; the exhibit launches it (torchrun, the legacy launcher,
`mp.spawn`) with a timeout and shows what the user sees. Modes that need no process group do not import torch,
so a launch costs only the launcher's own start.

    strict_args   argparse that knows only its own options (rejects the legacy launcher's --local-rank)
    env           print what torchrun told this process (RANK, LOCAL_RANK, WORLD_SIZE, restarts), then
                  sleep (seconds, or until:PATH exists) and exit
    shapes        all_reduce of 4 floats on rank 0 and 8 on rank 1 (gloo aborts the process)
    threads       print this process's torch threads and a DataLoader worker's (under torchrun)
    threads_spawn N   the same from N processes started by mp.spawn
    hang          rank 0 enters an all_reduce that rank 1 never joins; faulthandler dumps the stacks on
                  a timer (dump_after_s timeout_s out_dir: each rank writes out_dir/faulthandler_rankR.txt)
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def strict_args(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="train.py")
    p.add_argument("mode")
    p.add_argument("--epochs", type=int, default=1)
    args = p.parse_args(argv)
    print(f"parsed: epochs={args.epochs}", flush=True)


def env(argv: list[str]) -> None:
    keys = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "GROUP_RANK",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_RUN_ID",
    )
    job = argv[0] if argv else "job"
    print(f"{job} " + " ".join(f"{k}={os.environ.get(k)}" for k in keys), flush=True)
    wait = argv[1] if len(argv) > 1 else "0"
    if wait.startswith(
        "until:"
    ):  # run until the file exists (at most 60 s): the exhibit decides when we end
        deadline = time.monotonic() + 60
        while not os.path.exists(wait[len("until:") :]) and time.monotonic() < deadline:
            time.sleep(0.1)
    else:
        time.sleep(float(wait))


def exhibit_spawn_worker(rank: int, world_size: int, port: int) -> None:
    """An importable mp.spawn target: rank comes first; MASTER_ADDR/PORT come from the environment."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # launched from a torchrun worker: not its agent's store
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    os.write(
        1, f"spawned rank {rank}: all_reduce sum {t.item():g}\n".encode()
    )  # one write: no interleaving
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(
        0
    )  # skip interpreter finalization: the gloo exit abort (common.harness.session.run_main)


def _threads_line(rank: int) -> str:
    import torch
    from torch.utils.data import DataLoader

    class Probe(
        torch.utils.data.Dataset
    ):  # a sample is the thread count of the process that loads it
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return torch.get_num_threads()

    in_worker = int(next(iter(DataLoader(Probe(), num_workers=1, multiprocessing_context="fork"))))
    return (
        f"rank {rank}: torch threads {torch.get_num_threads()}, DataLoader worker "
        f"threads {in_worker}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}\n"
    )


def threads_child(rank: int) -> None:
    """An importable mp.spawn target: one line about this process's threads, in one write."""
    os.write(1, _threads_line(rank).encode())
    sys.stdout.flush()
    os._exit(0)


def threads(argv: list[str]) -> None:
    os.write(1, _threads_line(int(os.environ.get("RANK", 0))).encode())


def threads_spawn(argv: list[str]) -> None:
    import torch
    import torch.multiprocessing as mp

    from common.exhibits.worker import (
        threads_child,
    )  # by its module's name: the children can import it

    print(f"one process alone: torch threads {torch.get_num_threads()}", flush=True)
    mp.spawn(threads_child, nprocs=int(argv[0]))


def _init(timeout_s: float):
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank()


def shapes(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    rank = _init(float(argv[0]) if argv else 5.0)
    grads = torch.ones(4 if rank == 0 else 8)  # e.g. a model built from a per-rank config
    dist.all_reduce(grads)
    print(f"rank {rank}: sum {grads.sum().item()}", flush=True)


def train_step(rank: int) -> None:
    import torch
    import torch.distributed as dist

    loss = torch.ones(1)
    if rank == 0:  # rank 0 logs the mean loss ...
        dist.all_reduce(loss)
    else:  # ... rank 1 took another branch and never joins
        time.sleep(600)


def hang(argv: list[str]) -> None:
    import faulthandler

    dump_after, timeout_s, out_dir = float(argv[0]), float(argv[1]), argv[2]
    rank = _init(timeout_s)
    # one file per rank: no interleaving
    dump = open(os.path.join(out_dir, f"faulthandler_rank{rank}.txt"), "w")
    # each rank's stack after dump_after s
    faulthandler.dump_traceback_later(dump_after, exit=False, file=dump)
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    train_step(rank)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:]]
    modes = {
        "strict_args": strict_args,
        "env": env,
        "shapes": shapes,
        "hang": hang,
        "threads": threads,
        "threads_spawn": threads_spawn,
    }
    mode = next(a for a in args if a in modes)
    if mode == "strict_args":
        strict_args(args)  # the user's parser sees every argument, the mode included
    else:
        modes[mode](args[args.index(mode) + 1 :])
    sys.stdout.flush()
    os._exit(0)
