"""Time of the website's build: both languages from the sources (staging, Sphinx with warnings as errors).

    python benchmarks/site_build.py                  # 3 builds, both languages side by side (the default)
    python benchmarks/site_build.py --serial --repeats 1

Each build lays everything afresh (staging, Sphinx's environment, the output), as `python -m website` does,
into a temporary folder. Printed: each build's wall time, the CPU seconds its processes used (user + system,
the Sphinx processes included), the load average at the start (the machine is shared: a wall time over the
CPU time per core means other work was running), and the median on a `[perf]` line.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

from website.build import build


def cpu_seconds() -> float:
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serial", action="store_true", help="one language after the other")
    args = parser.parse_args(argv)
    walls = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            load = os.getloadavg()[0]
            cpu0, t0 = cpu_seconds(), time.perf_counter()
            build(serial=args.serial, out=Path(tmp) / "site", staging=Path(tmp) / "site-src")
            wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
        walls.append(wall)
        print(
            f"build {i + 1}: {wall:.1f} s wall, {cpu:.1f} s CPU, load average {load:.1f} on "
            f"{os.cpu_count()} cores",
            flush=True,
        )
    print(
        f"[perf] site build (en + zh, {'serial' if args.serial else 'side by side'}): median "
        f"{statistics.median(walls):.1f} s wall over {len(walls)}"
    )


if __name__ == "__main__":
    main()
