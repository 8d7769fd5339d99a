"""Weak scaling of lesson 03: throughput with 1 and 2 processes, measured side by side.

    python benchmarks/ddp_scaling.py                  # digits (8x8) and synthetic 32x32 images, batch 32/process
    python benchmarks/ddp_scaling.py --rounds 5 --batch-sizes 32 128

Weak scaling keeps the batch PER PROCESS fixed, so 2 processes do twice the work per step. Efficiency is
    throughput(2 processes) / (2 x throughput(1 process)),
1.0 being perfect; the speed-up throughput(2) / throughput(1) = 2 x efficiency is how much faster 2 processes
get through the data than one (efficiency 0.52 -> 1.04x: the second process adds 4%, not half its worth). Launches alternate (1, 2, 1, 2, ...) so that a noisy neighbour slows both sides alike; the
first epoch of every run is dropped as warm-up, and the median over rounds is reported. Both sides run under
torchrun (1 and 2 processes, one thread each), so process-group setup is on both sides too.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

from common.run.launch import run_lesson


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument(
        "--datasets",
        nargs="+",
        default=["digits", "synthetic"],
        help="digits: 8x8 images, 38k parameters, milliseconds of compute per step, so the all-reduce "
        "weighs heavily; synthetic: 32x32 images, 16x the convolution work per sample, 530k "
        "parameters",
    )
    args = p.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.system()}"
    )
    for dataset, bs in [(d, b) for d in args.datasets for b in args.batch_sizes]:
        thr = {1: [], 2: []}
        rss = []
        for _ in range(args.rounds):
            for nproc in (1, 2):
                run = run_lesson(
                    "03_ddp",
                    nproc=nproc,
                    share=False,  # each round a launch of its own
                    args=[
                        "--epochs",
                        str(args.epochs),
                        "--batch-size",
                        str(bs),
                        "--device",
                        "cpu",
                        "--dataset",
                        dataset,
                    ],
                    timeout_s=600,
                ).check()
                thr[nproc].append(statistics.mean(run.results["samples_per_s"][1:]))
                if nproc == 2:
                    rss += [f["peak_rss_mb"] for f in run.results["ranks"]]
                    wall = run.wall_s
        t1, t2 = statistics.median(thr[1]), statistics.median(thr[2])
        print(
            f"{dataset}, batch {bs}/process: 1 process {t1:,.0f} samples/s, 2 processes {t2:,.0f} samples/s, "
            f"weak-scaling efficiency {t2 / (2 * t1):.2f}, speed-up {t2 / t1:.2f}x; peak RSS per process "
            f"{max(rss):.0f} MB; "
            f"last 2-process launch {wall:.1f} s wall"
        )


if __name__ == "__main__":
    main()
