"""DDP's communication, counted: PyTorch's own comm hooks by name, ready for CPU/gloo as for CUDA/NCCL (lesson 17).

    hook, state = comm_hook("bf16")          # "allreduce", "fp16", "bf16", "powersgd1", "powersgd2", ...
    ddp_model.register_comm_hook(state, hook)

- "allreduce": `default_hooks.allreduce_hook`, the Python twin of DDP's built-in reduction (sum, / world_size).
  Registered as the baseline, it makes every variant's traffic go through `dist.all_reduce` in Python, where
  `common.measure.counters.count_collectives` counts calls and bytes the same way for all of them.
- "fp16" / "bf16": `default_hooks.fp16_compress_hook` / `bf16_compress_hook`: cast the bucket to 16 bits,
  all-reduce, cast back: half the bytes, a relative rounding error per value of ~5e-4 (fp16, for values above ~6e-5; smaller ones lose precision)
  or ~4e-3 (bf16).
- "powersgdR": `powerSGD_hook.powerSGD_hook` with rank R (Vogels et al., 2019, https://arxiv.org/abs/1905.13727):
  each gradient matrix M (n x m) is sent as P (n x R) and Q (m x R) with M ~ P Q^T, the error fed back into the
  next step; vectors (biases) and matrices that would not shrink by min_compression_rate (2) travel as they are.
  The first `start_powerSGD_iter` (2) steps all-reduce plainly (DDP rebuilds its buckets after step 1, unless
  find_unused_parameters=True without static_graph: then the first buckets are capped and never rebuilt).
- `allreduces_per_backward`, `gradient_storage_bytes`, `predicted_buckets`: the counts lesson 17 claims.

Two facts measured here (torch 2.13, gloo, CPU):
1. DDP refuses a hook whose `__name__` is "bf16_compress_hook" unless CUDA with NCCL >= 2.10 is present; gloo
   sums bfloat16 on CPU (tests/unit/test_profiling.py checks it), so `comm_hook` registers it under another name.
2. `powerSGD_hook` waits for its second all-reduce inside a future callback; gloo completes futures on its worker
   threads, and with two or more buckets in flight the step never finished here (3 buckets hung; 1 bucket
   trains). Under gloo, give PowerSGD one bucket: `bucket_cap_mb` >= the gradient's MB. The hook is written
   for NCCL; we have not run it there.
3. A PowerSGD state is training state (error feedback per rank, warm-start P and Q, its RNG, iter): lesson 17's
   `resume_powersgd` restores it exactly, with `plain_until_switched` for the one backward that rebuilds buckets.
Docs: https://pytorch.org/docs/stable/ddp_comm_hooks.html
"""

# No `from __future__ import annotations`: DDP checks that a hook's annotations are the real GradBucket and
# Future classes (common/measure/counters.py says the same).
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from common.measure.counters import count_collectives
from common.measure.memory import storage_bytes

__all__ = [
    "HOOKS",
    "comm_hook",
    "powersgd_rank",
    "plain_until_switched",
    "keeping_buffers",
    "allreduces_per_backward",
    "gradient_storage_bytes",
    "predicted_buckets",
]

HOOKS = ("allreduce", "fp16", "bf16", "powersgd1", "powersgd2", "powersgd4")


def powersgd_rank(name: str) -> int:
    """ "powersgd4" -> 4; 0 for a hook that is not PowerSGD."""
    return int(name[len("powersgd") :]) if name.startswith("powersgd") else 0


def _wrap(hook):
    """`hook` under the name "compressed_hook" (DDP's bf16 check looks at the name only; see the docstring)."""

    def compressed_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return hook(state, bucket)

    return compressed_hook


def comm_hook(name: str, process_group=None, seed: int = 0):
    """(hook, state) for `ddp_model.register_comm_hook(state, hook)`; see the module docstring for the names.

    Raises:
        ValueError: an unknown name or a PowerSGD rank below 1.
    """
    if name == "allreduce":
        return default_hooks.allreduce_hook, process_group
    if name in ("fp16", "bf16"):
        hook = (
            default_hooks.fp16_compress_hook if name == "fp16" else default_hooks.bf16_compress_hook
        )
        return _wrap(hook), process_group
    rank = powersgd_rank(name) if name[len("powersgd") :].isdigit() else 0
    if rank < 1:
        raise ValueError(
            f"unknown comm hook {name!r}: expected one of {HOOKS} (powersgdR for any rank R >= 1)"
        )
    state = powerSGD_hook.PowerSGDState(
        process_group=process_group,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=2,
        random_seed=seed,
    )
    return _wrap(powerSGD_hook.powerSGD_hook), state


def plain_until_switched(hook):
    """(a hook that all-reduces plainly until `switch()` is called, then runs `hook`; switch). Lesson 17's
    exact PowerSGD resume runs one backward through the plain path so that DDP rebuilds its buckets before
    the hook and its restored state see a bucket (DDP without find_unused_parameters: with it, no rebuild)."""
    plain = [True]

    def resumed_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return default_hooks.allreduce_hook(None, bucket) if plain[0] else hook(state, bucket)

    def switch() -> None:
        plain[0] = False

    return resumed_hook, switch


def keeping_buffers(buffers: list):
    """The "allreduce" hook that also appends each bucket's flat buffer to `buffers` (to count storages:
    with gradient_as_bucket_view=True every .grad is a view into one of them)."""

    def allreduce_keeping_buffer(
        state, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        buffers.append(bucket.buffer())
        return default_hooks.allreduce_hook(state, bucket)

    return allreduce_keeping_buffer


def allreduces_per_backward(model, batch, steps: int = 4, hook: str = "allreduce") -> tuple:
    """Register `hook` on the DDP `model`, run `steps` backward passes on batch = (x, y): (all-reduce calls of
    each pass, bytes all-reduced in the last pass), counted in Python by `common.measure.counters.count_collectives`."""
    hook_fn, state = comm_hook(hook)
    model.register_comm_hook(state, hook_fn)
    calls, nbytes = [], 0
    for _ in range(steps):
        with (
            count_collectives() as c
        ):  # a PowerSGD hook's later all-reduces run before backward returns
            F.cross_entropy(model(batch[0]), batch[1]).backward()
        calls.append(c.calls.get("all_reduce", 0))
        nbytes = c.bytes.get("all_reduce", 0)
        model.zero_grad(set_to_none=True)
    return calls, nbytes


def gradient_storage_bytes(model, batch) -> int:
    """Bytes of the storages behind every .grad of the DDP `model` and its bucket buffers (each storage once),
    after 2 backward passes on batch = (x, y): 2 x the gradient without gradient_as_bucket_view, 1 x with it."""
    buffers = []  # the flat bucket tensors DDP all-reduces, kept by the hook
    model.register_comm_hook(None, keeping_buffers(buffers))
    for _ in range(
        2
    ):  # pass 1 runs with one bucket; buckets are rebuilt for pass 2 (no find_unused_parameters)
        buffers.clear()
        F.cross_entropy(model(batch[0]), batch[1]).backward()
    return storage_bytes([p.grad for p in model.module.parameters()] + buffers)


def predicted_buckets(model, first_bucket_bytes: int | None = None) -> int:
    """DDP's bucketing rule: gradients in reverse parameter order (about the order backward produces them), a
    bucket closes once it holds >= its cap. torch 2.13: bucket_cap_mb left at None caps the FIRST bucket at 1 MiB
    and the rest at 25 MiB (so communication starts early); an explicit bucket_cap_mb caps every bucket.
    (Without find_unused_parameters the first backward of a new DDP model uses one bucket and these are the
    buckets it rebuilds after it; with find_unused_parameters=True alone DDP starts with these buckets and
    never rebuilds them: nn/parallel/distributed.py's compute_bucket_size_limits, reducer.hpp.)

    `first_bucket_bytes` overrides the first cap: torch.compile's DDPOptimizer cuts its graphs by this rule with
    a 1 MiB first bucket whatever DDP's is (torch/_dynamo/convert_frame.py passes only bucket_bytes_cap)."""
    config = getattr(model, "_bucket_config", None)  # older torch: a 1 MiB first bucket always
    limit = config.first_bucket_bytes_cap if config else dist._DEFAULT_FIRST_BUCKET_BYTES
    limit = first_bucket_bytes or limit
    size = buckets = 0
    for p in reversed(list(model.module.parameters())):
        size += p.numel() * p.element_size()
        if size >= limit:
            buckets, size, limit = buckets + 1, 0, model.bucket_bytes_cap
    return buckets + (size > 0)
