"""PyTorch's own gradient-compression hooks by name, ready for CPU/gloo as for CUDA/NCCL (lesson 18).

    hook, state = comm_hook("bf16")          # "allreduce", "fp16", "bf16", "powersgd1", "powersgd2", ...
    ddp_model.register_comm_hook(state, hook)

- "allreduce": `default_hooks.allreduce_hook`, the Python twin of DDP's built-in reduction (sum, / world_size).
  Registered as the baseline, it makes every variant's traffic go through `dist.all_reduce` in Python, where
  `common.measure.counters.count_collectives` counts calls and bytes the same way for all of them.
- "fp16" / "bf16": `default_hooks.fp16_compress_hook` / `bf16_compress_hook`: cast the bucket to 16 bits,
  divide by the world size, all-reduce, cast back: half the bytes, a relative rounding error per value of
  ~5e-4 (fp16, for values above ~6e-5; smaller ones lose precision) or ~4e-3 (bf16).
- "powersgdR": `powerSGD_hook.powerSGD_hook` with rank R (Vogels et al., 2019, arXiv 1905.13727): each
  gradient matrix M (n x m) is sent as P (n x R) and Q (m x R) with M ~ P Q^T, the error fed back into the
  next step; vectors (biases) and matrices that would not shrink by min_compression_rate (2) travel as they
  are (`common.compression.powersgd.powersgd_numel` counts what travels). The first `start_powerSGD_iter` (2) steps all-reduce plainly
  (DDP rebuilds its buckets after step 1, unless find_unused_parameters=True without static_graph).

Three facts measured here (torch 2.13, gloo, CPU):
1. DDP refuses a hook whose `__name__` is "bf16_compress_hook" unless CUDA with NCCL >= 2.10 is present; gloo
   sums bfloat16 on CPU (tests/unit/test_profiling.py checks it), so `comm_hook` registers it under another
   name.
2. `powerSGD_hook` waits for its second all-reduce inside a future callback; gloo completes futures on its
   worker threads, and with two or more buckets in flight the step never finished here (3 buckets hung;
   1 bucket trains). Under gloo, give PowerSGD one bucket: `bucket_cap_mb` >= the gradient's MB. The hook is
   written for NCCL; we have not run it there.
3. A PowerSGD state is training state (error feedback per rank, warm-start P and Q, its RNG, iter): lesson
   18's `resume_powersgd` restores it exactly, with `plain_until_switched` for the one backward that rebuilds
   the buckets.
Docs: https://pytorch.org/docs/stable/ddp_comm_hooks.html
"""

# No `from __future__ import annotations`: DDP checks that a hook's annotations are the real GradBucket and
# Future classes (common/measure/counters.py says the same).
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from common.measure.counters import count_collectives

__all__ = ["HOOKS", "comm_hook", "powersgd_rank", "plain_until_switched", "gradients_through"]

HOOKS = ("allreduce", "fp16", "bf16", "powersgd1", "powersgd2", "powersgd4")


def powersgd_rank(name: str) -> int:
    """ "powersgd4" -> 4; 0 for a hook that is not PowerSGD."""
    return int(name[len("powersgd") :]) if name.startswith("powersgd") else 0


def _wrap(hook):
    """`hook` under the name "compressed_hook" (DDP's bf16 check looks at the name only; see the docstring)."""

    def compressed_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return hook(state, bucket)

    return compressed_hook


def comm_hook(name: str, process_group=None, seed: int = 0, **powersgd):
    """(hook, state) for `ddp_model.register_comm_hook(state, hook)`; see the module docstring for the names.
    `powersgd` goes to PowerSGDState (use_error_feedback=False, warm_start=False, ...).

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
        **powersgd,
    )
    return _wrap(powerSGD_hook.powerSGD_hook), state


def plain_until_switched(hook):
    """(a hook that all-reduces plainly until `switch()` is called, then runs `hook`; switch). Lesson 18's
    exact PowerSGD resume runs one backward through the plain path so that DDP rebuilds its buckets before
    the hook and its restored state see a bucket (DDP without find_unused_parameters: with it, no rebuild)."""
    plain = [True]

    def resumed_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return default_hooks.allreduce_hook(None, bucket) if plain[0] else hook(state, bucket)

    def switch() -> None:
        plain[0] = False

    return resumed_hook, switch


def gradients_through(ddp_model, batch, passes: int = 1) -> tuple[list, int]:
    """`passes` backward passes of the DDP model on batch = (x, y), no optimizer step, through the hook it
    has registered: (each pass's averaged gradient as DDP wrote it into .grad, flat; the bytes the hook
    all-reduced in the last pass, counted by `count_collectives`)."""
    grads, nbytes = [], 0
    for _ in range(passes):
        with count_collectives() as c:
            F.cross_entropy(ddp_model(batch[0]), batch[1]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in ddp_model.module.parameters()]))
        nbytes = c.bytes.get("all_reduce", 0)
        ddp_model.zero_grad(set_to_none=True)
    return grads, nbytes
