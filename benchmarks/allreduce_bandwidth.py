"""All-reduce bandwidth: dist.all_reduce against lesson 02's ring of isend/irecv, per message size (lesson 02).

    torchrun --standalone --nproc_per_node=2 benchmarks/allreduce_bandwidth.py
    torchrun --standalone --nproc_per_node=4 benchmarks/allreduce_bandwidth.py --sizes-kib 64 1024 16384
    torchrun --standalone --nproc_per_node=8 benchmarks/allreduce_bandwidth.py --device cuda   # 8 GPUs, NCCL

For each size and each implementation: `--warmup` untimed calls, then `--iters` calls timed one by one (a barrier
before each; on CUDA the device is synchronised around it); a call's time is the slowest rank's. The line shows
the median and the quartiles, algbw = bytes / median and busbw = algbw x 2(n-1)/n
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md). Every number here is a timing: it depends
on the machine and its load, and no ordering between the two implementations is claimed. On one CPU the "links"
are shared memory, and the Python ring pays 2(n-1) messages and Python overhead per call.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from common.collectives.ring import ring_all_reduce
from common.harness.env import LessonError
from common.harness.results import Report
from common.harness.session import add_distributed_args, barrier, distributed_session, run_main
from common.measure.bandwidth import (
    bandwidths,
    bus_bandwidth_factor,
    five_number_summary,
    time_calls,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--sizes-kib",
        type=int,
        nargs="+",
        default=[4, 64, 256, 1024],
        help="message sizes in KiB (float32) (default %(default)s)",
    )
    p.add_argument(
        "--iters", type=int, default=20, help="timed calls per size and op (default %(default)s)"
    )
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed calls first (default %(default)s)"
    )
    p.add_argument("--results", default=None, help="rank 0 writes the timings here as JSON")
    add_distributed_args(p)
    args = p.parse_args(argv)
    bad = [s for s in args.sizes_kib if s < 1]
    if bad:
        raise LessonError(f"--sizes-kib must be positive integers (KiB), got {bad[0]}")
    if args.iters < 1:
        raise LessonError(f"--iters must be >= 1, got {args.iters}")
    if args.warmup < 0:
        raise LessonError(f"--warmup must be >= 0, got {args.warmup}")
    return args


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        n, dev, report = info.world_size, info.device, Report(info)
        report.results.update(
            world_size=n,
            backend=info.backend,
            device=dev.type,
            iters=args.iters,
            warmup=args.warmup,
        )
        rows = []
        if not info.distributed:
            print("no process group: run it under torchrun with 2 or more processes", flush=True)
        else:
            report.value(
                "busbw_factor",
                bus_bandwidth_factor("all_reduce", n),
                f"{n} ranks, {info.backend}/{dev.type}: busbw = algbw x 2(n-1)/n = algbw x {{value:.4f}}; "
                f"median [quartiles] of {args.iters} calls after {args.warmup} warm-up calls",
            )
            for kib in args.sizes_kib:
                buf = torch.zeros(
                    kib * 256, device=dev
                )  # kib KiB of float32; zeros: repeated sums never overflow
                for op, fn in (
                    ("all_reduce", lambda: dist.all_reduce(buf)),
                    ("ring", lambda: ring_all_reduce(buf)),
                ):
                    s = five_number_summary(
                        time_calls(fn, args.iters, args.warmup, dev, info.distributed)
                    )
                    algbw, busbw = bandwidths(kib * 1024, s["median"], n)
                    rows.append(
                        {
                            "op": op,
                            "size_bytes": kib * 1024,
                            **s,
                            "algbw_GBps": algbw,
                            "busbw_GBps": busbw,
                        }
                    )
                    report.perf(
                        f"{op}_{kib}kib",
                        s,
                        f"{op:>10} {kib:>6} KiB: {s['median'] * 1e3:8.3f} ms "
                        f"[{s['q1'] * 1e3:.3f}, {s['q3'] * 1e3:.3f}]  algbw {algbw:7.3f} GB/s  "
                        f"busbw {busbw:7.3f} GB/s",
                    )
        report.record("bandwidth", rows)
        report.write(args.results)
        barrier(info)


if __name__ == "__main__":
    run_main(main)
