"""Wrong: Adam's state counted as one fp32 tensor the size of the parameters (exp_avg only; exp_avg_sq
forgotten)."""

from exercises.solutions.predict_memory import bytes_per_rank as _right


def bytes_per_rank(units, world_size, stage):
    out = _right(units, world_size, stage)
    tensors = len(units) if stage else sum(len(list(u.parameters())) for u in units)
    out["optimizer_state"] = (out["optimizer_state"] - 4 * tensors) // 2 + 4 * tensors  # the bug
    return out
