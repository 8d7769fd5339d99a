"""Wrong: stage 2 counted as if it sharded the parameters at rest too (that is stage 3)."""

from exercises.solutions.predict_memory import bytes_per_rank as _right


def bytes_per_rank(units, world_size, stage):
    out = _right(units, world_size, stage)
    if stage == 2:
        out["parameters"] = _right(units, world_size, 3)["parameters"]  # the bug
    return out
