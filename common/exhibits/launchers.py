"""Lesson 12's exhibits of launch mistakes: each runs real launchers as bounded subprocesses on rank 0.

The scripts they launch are the modes of `common.exhibits.worker` (most import no torch, so a launch
costs only the launcher's start). Every subprocess has a timeout and is killed with its whole process group
after it.
"""

from __future__ import annotations

import argparse
import re
import socket
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor

from common.exhibits.frame import Ctx, exhibit, first_line, normalise
from common.harness.options import add_legacy_launcher_args
from common.harness.spawn import free_port

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
WORKER = ["-m", "common.exhibits.worker"]


@exhibit(
    "legacy_launcher_local_rank",
    "launch",
    lesson="03",
    symptom="error: unrecognized arguments: --local-rank=0",
    cause="the deprecated launcher appends --local-rank=N to the script's arguments; torchrun does not",
    when="under python -m torch.distributed.launch",
    fix="torchrun (no --local-rank; LOCAL_RANK in the environment)",
)
def legacy_launcher_local_rank(ctx: Ctx) -> None:
    with ctx.rank0("the legacy launcher") as mine:
        if not mine:
            return
        code, out = ctx.launch(
            [
                sys.executable,
                "-m",
                "torch.distributed.launch",
                "--nproc_per_node=1",
                *WORKER,
                "strict_args",
            ],
            60,
        )
        line = first_line(out, "unrecognized arguments")
        ctx.step("symptom", "python -m torch.distributed.launch --nproc_per_node=1 train.py")
        ctx.say(f"    {line}")
        ctx.record("symptom", line)
        ctx.claim(
            "broken_rejected",
            int(code != 0 and "--local-rank=0" in line),
            "==",
            1,
            "the script's argparse rejects --local-rank=0: {value}",
        )
        warning = first_line(out, "is deprecated", limit=400)
        ctx.step("diagnosis", "the launcher warned: " + warning[warning.find("The module") :][:90])
        p = add_legacy_launcher_args(argparse.ArgumentParser(prog="train.py"))
        p.add_argument("mode")
        parsed = p.parse_args(["--local-rank=0", "strict_args"])
        ctx.step(
            "fix",
            "torchrun (no --local-rank; LOCAL_RANK in the environment), or accept and ignore it: "
            "common.harness.options.add_legacy_launcher_args",
        )
        ctx.claim(
            "fixed_parses",
            int(parsed.mode == "strict_args"),
            "==",
            1,
            "the same argv parses: {value}",
        )


@exhibit(
    "local_rank_from_global_rank",
    "launch",
    lesson="03",
    symptom="RuntimeError: CUDA error: invalid device ordinal",
    cause="local_rank = dist.get_rank(): the global rank (2, 3 on node 1) used as this node's GPU index",
    when="on the second node only (GPU only: here the device indices are shown)",
    fix="device = cuda:LOCAL_RANK",
)
def local_rank_from_global_rank(ctx: Ctx) -> None:
    with ctx.rank0("two nodes on loopback") as mine:
        if not mine:
            return
        gpus_per_node = 2  # --nproc_per_node=2: one process per GPU
        cmd = [
            *TORCHRUN,
            "--nnodes=2",
            f"--nproc_per_node={gpus_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            f"--rdzv-id=job-{uuid.uuid4().hex[:8]}",
            *WORKER,
            "env",
            "node",
        ]
        with ThreadPoolExecutor(
            2
        ) as pool:  # two "nodes": the same command twice, joined by the rendezvous
            outs = [out for _, out in pool.map(lambda _: ctx.launch(cmd, 90), range(2))]
        procs = sorted(
            (int(r), int(lr))
            for r, lr in re.findall(r"node RANK=(\d+) LOCAL_RANK=(\d+)", "".join(outs))
        )
        wrong = [r for r, _ in procs]  # torch.cuda.set_device(dist.get_rank())
        bad = [i for i in wrong if i >= gpus_per_node]
        ctx.step(
            "symptom",
            f"2 nodes x {gpus_per_node} processes (torchrun on loopback), device index = "
            f"dist.get_rank(): {wrong}; indices {bad} do not exist on a {gpus_per_node}-GPU node -> "
            "'CUDA error: invalid device ordinal' (the GPU message; nothing on CPU)",
        )
        ctx.record("ranks", procs)
        ctx.claim(
            "broken_invalid_indices",
            len(bad) if len(procs) == 4 else 0,
            "==",
            2,
            "device indices out of range, over the 4 processes: {value}",
        )
        ctx.step("diagnosis", "print RANK, LOCAL_RANK and torch.cuda.device_count() on each node")
        right = [lr for _, lr in procs]
        ctx.step("fix", f"device = cuda:LOCAL_RANK (common.harness.env.read_torchrun_env): {right}")
        ctx.claim(
            "fixed_invalid_indices",
            sum(i >= gpus_per_node for i in right) if len(procs) == 4 else 1,
            "==",
            0,
            "device indices out of range with LOCAL_RANK: {value}",
        )


SPAWN_SCRIPT = """
import torch.multiprocessing as mp
def worker(rank):           # defined where the children cannot import it: a notebook cell, python -c, stdin
    print("worker", rank)
if __name__ == "__main__":
    try:
        mp.spawn(worker, nprocs=1)
    except Exception as e:
        print("parent:", type(e).__name__ + ":", str(e).splitlines()[0], flush=True)
    from common.exhibits.worker import exhibit_spawn_worker   # importable: the fix
    mp.spawn(exhibit_spawn_worker, args=(2, {port}), nprocs=2)
"""


@exhibit(
    "mp_spawn_inline_function",
    "launch",
    lesson="03",
    symptom="AttributeError: Can't get attribute 'worker' on <module '__main__' (built-in)>",
    cause="spawn starts fresh interpreters that unpickle the "
    "function by name; a notebook's __main__ has none",
    when="from mp.spawn of a function defined in a notebook",
    fix="define the worker in a module and import it",
)
def mp_spawn_inline_function(ctx: Ctx) -> None:
    with ctx.rank0("mp.spawn") as mine:
        if not mine:
            return
        port = free_port()
        code, out = ctx.launch([sys.executable, "-c", SPAWN_SCRIPT.format(port=port)], 90)
        child = first_line(out, "Can't get attribute")
        ctx.step(
            "symptom", "mp.spawn(worker) with worker defined in a notebook cell (here: python -c)"
        )
        ctx.say(f"    child:  {child}")
        ctx.say(f"    {first_line(out, 'parent:')}")
        ctx.record("symptom", child)
        ctx.claim(
            "broken_child_fails",
            int("Can't get attribute 'worker'" in child),
            "==",
            1,
            "the child cannot find the function: {value}",
        )
        ctx.step(
            "diagnosis",
            "the child's traceback ends in pickle: it imports the function by module and name",
        )
        sums = sorted(re.findall(r"spawned rank \d+: all_reduce sum \d+", out))
        ctx.step("fix", "define the worker in a module and import it: " + "; ".join(sums))
        ctx.claim("fixed_ranks", len(sums), "==", 2, "ranks that ran the imported worker: {value}")


@exhibit(
    "rendezvous_port_taken",
    "launch",
    lesson="03",
    symptom="torch.distributed.DistNetworkError: The server socket has failed to listen on any "
    "local network address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE",
    cause="another job already listens on the port given by --master-port (static rendezvous; "
    "torchrun on one node without it takes a free port: c10d at localhost:0)",
    fix="on one machine drop --master-port or pass --standalone",
)
def rendezvous_port_taken(ctx: Ctx) -> None:
    with ctx.rank0("a launch on a taken port") as mine:
        if not mine:
            return
        with socket.socket() as other_job:  # another job's store listens here
            other_job.bind(("127.0.0.1", 0))
            other_job.listen()
            port = other_job.getsockname()[1]
            code, out = ctx.launch(
                [
                    *TORCHRUN,
                    "--nnodes=1",
                    "--nproc_per_node=1",
                    f"--master-port={port}",
                    *WORKER,
                    "env",
                    "job",
                ],
                60,
            )
            line = normalise(first_line(out, "EADDRINUSE", limit=400), [port])
            line = line[line.find("The server socket") :][:150]
            ctx.step(
                "symptom",
                "torchrun --nproc_per_node=1 --master-port=PORT while another job holds PORT",
            )
            ctx.say(f"    {line}")
            ctx.record("symptom", line)
            ctx.claim(
                "broken_fails",
                int(code != 0 and "EADDRINUSE" in line),
                "==",
                1,
                "the launch fails with EADDRINUSE: {value}",
            )
            ctx.step("diagnosis", "ss -ltnp | grep PORT (or lsof -i :PORT) shows who listens there")
            standalone = [*TORCHRUN, "--standalone", "--nproc_per_node=1", *WORKER, "env", "job"]
            code, out = ctx.launch(standalone, 60)
        ctx.step(
            "fix",
            "on one machine drop --master-port or pass --standalone (c10d at localhost:0: a free "
            "port, a fresh run id); across machines a --master-port nobody holds",
        )
        ctx.claim(
            "fixed_runs",
            int(code == 0 and "job RANK=0" in out),
            "==",
            1,
            "the --standalone launch runs beside it: {value}",
        )
