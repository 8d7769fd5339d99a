"""Grader of exercises/one_f_one_b.py: the same order as lesson 09's schedule (common.pipeline.schedules)."""

from __future__ import annotations

import importlib

from common.pipeline.schedules import one_f_one_b_order as reference

WORLD_SIZE = 0
FUNCTIONS = ["one_f_one_b_order"]


def _show(order) -> str:
    return " ".join(f"{kind}{i}" for kind, i in order)


def _peak(order) -> int:
    live = peak = 0
    for kind, _ in order:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def check(module: str) -> list[str]:
    mine = importlib.import_module(module).one_f_one_b_order
    for pp_size in (1, 2, 3, 4):
        for m in (1, 2, 3, 4, 8):
            for pp_rank in range(pp_size):
                got = [tuple(a) for a in mine(m, pp_size, pp_rank)]
                want = reference(m, pp_size, pp_rank)
                if got == want:
                    continue
                case = f"{m} micro-batches, {pp_size} stages, stage {pp_rank}"
                if sorted(got) != sorted(want):
                    hint = "each micro-batch must appear once as F and once as B"
                elif _peak(got) > _peak(want):
                    hint = (
                        f"it holds {_peak(got)} micro-batches' activations at once, 1F1B holds "
                        f"{_peak(want)}: start the backwards after min(p - 1 - stage, m) forwards"
                    )
                else:
                    hint = "the warm-up is min(pp_size - 1 - pp_rank, m) forwards, then F and B alternate"
                return [f"{case}: yours {_show(got)}; expected {_show(want)}: {hint}"]
    return []
