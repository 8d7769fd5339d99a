"""The launchers' legacy option (--local-rank, which torch.distributed.launch appends), its note, and the
comma-separated integers option type (lesson 09)."""

from __future__ import annotations

import argparse
import os

from common.harness.env import LessonError

__all__ = ["add_legacy_launcher_args", "comma_ints", "legacy_launcher_note"]


def add_legacy_launcher_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Accept `--local-rank N` / `--local_rank N`, which `python -m torch.distributed.launch` appends.

    That launcher is deprecated but still in torch 2.13 and in most older tutorials. It sets LOCAL_RANK in the
    environment too, and that is what `setup` reads, so the value is ignored; `legacy_launcher_note` says once that torchrun
    replaces the launcher (https://pytorch.org/docs/stable/distributed.html#launch-utility).
    """
    parser.add_argument(
        "--local-rank",
        "--local_rank",
        dest="legacy_local_rank",
        type=int,
        default=None,
        help=argparse.SUPPRESS,
    )
    return parser


def comma_ints(text: str) -> list[int]:
    """'10,4' -> [10, 4]: an option that takes a list of integers. Raises LessonError otherwise."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise LessonError(f"expected comma-separated integers, got {text!r}") from None


def legacy_launcher_note(args: argparse.Namespace) -> None:
    """Rank 0 says once that `torch.distributed.launch` (which passed --local-rank) is replaced by torchrun."""
    if (
        getattr(args, "legacy_local_rank", None) is not None
        and int(os.environ.get("RANK", "0")) == 0
    ):
        print(
            "note: --local-rank came from the deprecated `python -m torch.distributed.launch`; it is ignored "
            "(LOCAL_RANK is read from the environment). Use torchrun: same options, no --local-rank.",
            flush=True,
        )
