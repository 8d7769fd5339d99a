"""DDP's gradient buckets, predicted and counted (lesson 17; lesson 07 predicts its buckets too).

    predicted_buckets(ddp_model)                  # DDP's bucketing rule, from the model's own caps
    calls, nbytes = allreduces_per_backward(ddp_model, (x, y))    # all-reduce calls of 4 backward passes
    gradient_storage_bytes(ddp_model, (x, y))     # bytes behind every .grad and every bucket buffer

The counts go through DDP's Python twin of its built-in reduction, `default_hooks.allreduce_hook` (sum, then
/ world_size), registered as a communication hook, so that `common.measure.counters.count_collectives` sees
every bucket's `dist.all_reduce` call and its bytes. Lesson 18 is about what else a hook can do.
"""

# No `from __future__ import annotations`: DDP checks that a hook's annotations are the real GradBucket and
# Future classes (common/measure/counters.py says the same).
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from common.measure.counters import count_collectives
from common.measure.memory import storage_bytes

__all__ = [
    "predicted_buckets",
    "allreduces_per_backward",
    "keeping_buffers",
    "gradient_storage_bytes",
]


def predicted_buckets(model, first_bucket_bytes: int | None = None) -> int:
    """DDP's bucketing rule: gradients in reverse parameter order (about the order backward produces them), a
    bucket closes once it holds >= its cap. torch 2.13: bucket_cap_mb left at None caps the FIRST bucket at
    1 MiB and the rest at 25 MiB (so communication starts early); an explicit bucket_cap_mb caps every bucket.
    (Without find_unused_parameters the first backward of a new DDP model uses one bucket and these are the
    buckets it rebuilds after it; with find_unused_parameters=True alone DDP starts with these buckets and
    never rebuilds them: nn/parallel/distributed.py's compute_bucket_size_limits, reducer.hpp.)

    `first_bucket_bytes` overrides the first cap: torch.compile's DDPOptimizer cuts its graphs by this rule
    with a 1 MiB first bucket whatever DDP's is (torch/_dynamo/convert_frame.py passes only
    bucket_bytes_cap)."""
    config = getattr(model, "_bucket_config", None)  # older torch: a 1 MiB first bucket always
    limit = config.first_bucket_bytes_cap if config else dist._DEFAULT_FIRST_BUCKET_BYTES
    limit = first_bucket_bytes or limit
    size = buckets = 0
    for p in reversed(list(model.module.parameters())):
        size += p.numel() * p.element_size()
        if size >= limit:
            buckets, size, limit = buckets + 1, 0, model.bucket_bytes_cap
    return buckets + (size > 0)


def allreduces_per_backward(model, batch, steps: int = 4) -> tuple:
    """Register the plain all-reduce hook on the DDP `model`, run `steps` backward passes on batch = (x, y):
    (all-reduce calls of each pass, bytes all-reduced in the last pass)."""
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    calls, nbytes = [], 0
    for _ in range(steps):
        with count_collectives() as c:
            F.cross_entropy(model(batch[0]), batch[1]).backward()
        calls.append(c.calls.get("all_reduce", 0))
        nbytes = c.bytes.get("all_reduce", 0)
        model.zero_grad(set_to_none=True)
    return calls, nbytes


def keeping_buffers(buffers: list):
    """The plain all-reduce hook that also appends each bucket's flat buffer to `buffers` (to count storages:
    with gradient_as_bucket_view=True every .grad is a view into one of them)."""

    def allreduce_keeping_buffer(
        state, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        buffers.append(bucket.buffer())
        return default_hooks.allreduce_hook(state, bucket)

    return allreduce_keeping_buffer


def gradient_storage_bytes(model, batch) -> int:
    """Bytes of the storages behind every .grad of the DDP `model` and its bucket buffers (each storage
    once), after 2 backward passes on batch = (x, y): 2 x the gradient without gradient_as_bucket_view,
    1 x with it."""
    buffers = []  # the flat bucket tensors DDP all-reduces, kept by the hook
    model.register_comm_hook(None, keeping_buffers(buffers))
    for _ in range(2):  # pass 1 runs with one bucket; pass 2 with the rebuilt ones
        buffers.clear()
        F.cross_entropy(model(batch[0]), batch[1]).backward()
    return storage_bytes([p.grad for p in model.module.parameters()] + buffers)
