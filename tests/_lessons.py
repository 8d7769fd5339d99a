"""Assertions shared by the lesson tests (tests/lessons/): claims and bad input."""

from __future__ import annotations

import torch

# The device arguments of a lesson's main run: `--device cpu` on a machine without a GPU, which is the command
# its notebook runs (so a test session launches it once, common/run/launch_cache.py), and the lesson's own choice
# (auto: the GPU) where there is one, so that a GPU machine still tests the GPU.
DEV: list[str] = [] if torch.cuda.is_available() else ["--device", "cpu"]


def assert_claims(results: dict, expected: set[str] | list[str]) -> dict:
    """The lesson recorded every claim in `expected`, and every claim it recorded holds.

    Returns the claims dict, so that a test can also check a value against a tighter or stated number.
    """
    claims = results.get("claims") or {}
    missing = set(expected) - set(claims)
    assert not missing, f"claims not recorded: {sorted(missing)}; recorded: {sorted(claims)}"
    failing = {k: c for k, c in claims.items() if not c["holds"]}
    assert not failing, f"claims that do not hold: {failing}"
    for (
        name,
        c,
    ) in claims.items():  # a recorded 'holds' must agree with its own value, bound and relation
        from common.harness.results import holds

        assert holds(c["value"], c["relation"], c["bound"]) == c["holds"], name
    return claims


def assert_fails_on_every_rank(run, nproc: int, message: str) -> None:
    """The launch failed, and each of the `nproc` ranks printed exactly one `[rank R] error: ...` line
    containing `message` (the promise every lesson makes for bad input)."""
    assert run.returncode != 0, run.stdout
    for rank in range(nproc):
        lines = [
            line for line in run.stderr.splitlines() if line.startswith(f"[rank {rank}] error:")
        ]
        assert len(lines) == 1 and message in lines[0], run.stderr


def assert_lines_fit(run, width: int = 120) -> None:
    """Every line the lesson printed on stdout is at most `width` characters (the formula belongs in the
    docstring; the printed line carries the number and what it means)."""
    long = [line for line in run.stdout.splitlines() if len(line) > width]
    assert not long, f"{len(long)} printed lines over {width} characters:\n" + "\n".join(long)
