"""python -m exercises [NAME ...] [--reference] [--list]: grade exercises; exit 1 while any does not pass."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from exercises import EXERCISES
from exercises._grading import grade, module_for
from exercises.graders._common import zh_line


def _file_of(module: str) -> str:
    """The file that was graded, relative to the current folder when it lies below it: `python -m` puts the
    current folder first on sys.path, so a copy of exercises/ elsewhere is graded only when you run from
    there."""
    spec = importlib.util.find_spec(module)
    path = Path(spec.origin) if spec and spec.origin else Path(module)
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exercises", description=__doc__)
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help="exercises to grade (default: all)"
    )
    parser.add_argument(
        "--reference", action="store_true", help="grade the reference solutions instead"
    )
    parser.add_argument("--list", action="store_true", help="list the exercises and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, (lesson, what) in EXERCISES.items():
            print(f"{name:22s} lesson {lesson}: {what}")
        return 0
    unknown = [n for n in args.names if n not in EXERCISES]
    if unknown:
        print(
            f"error: unknown exercise(s) {', '.join(unknown)}; choose from {', '.join(EXERCISES)}",
            file=sys.stderr,
        )
        return 2
    failed = []
    for name in args.names or list(EXERCISES):
        t0 = time.perf_counter()
        problems = grade(name, module_for(name, args.reference))
        mark = "pass" if not problems else "FAIL"
        where = _file_of(module_for(name, args.reference))
        print(
            f"{mark}  {name} (lesson {EXERCISES[name][0]}): {where}  [{time.perf_counter() - t0:.1f} s]",
            flush=True,
        )
        for p in problems:
            print(f"      - {p}", flush=True)
            print(f"        {zh_line(name, EXERCISES[name][0], p)}", flush=True)
        if problems:
            failed.append(name)
    total = len(args.names or EXERCISES)
    if failed:
        print(f"{total - len(failed)} of {total} exercises pass; not yet: {', '.join(failed)}")
        return 1
    print(f"all {total} exercises pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
