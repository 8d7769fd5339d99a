"""Wrong: the accumulation line copied in: gradient sync turned off for good, so nothing is ever reduced."""

from exercises.solutions.hsdp_wrapping import shard_hsdp as _right


def shard_hsdp(model, world_size, replicate):
    model = _right(model, world_size, replicate)
    model.set_requires_gradient_sync(False)
    return model
