"""One FSDP2 step measured, and training on sharded slices against one process (lesson 14).

- `backward_outcome(build, x, y)`: `build()` and one backward, tried (CPUOffloadPolicy): the gradients' device,
  or the error.
- `gradient_bytes(model)`: the gradient bytes a rank holds: the sharded ones (`p.grad`) and the unsharded ones
  FSDP2 keeps on its own objects while gradient sync is off (no public API reports those).
- `one_step_profile(model, x, y, mine)`: one step's all-gathers, the parameter bytes held after forward (the
  most over ranks).
- `one_backward(model, x, y)`: one backward: the full gradients, the bytes per collective, the gradients' dtype.
- `train_sharded(model, batches, mine, lr, micro, sync_each)`: SGD on this rank's slices, accumulating;
  `one_process(model, batches, lr)`: the reference, SGD on each whole global batch; `world_of_one()`: the
  environment torchrun would set for one process (FSDP2 needs a process group); `check_fsdp2_options(args,
  n, dtypes)`: the lesson's options checked, --replicate and --reshard-int filled in."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from common.harness.env import LessonError
from common.measure.counters import count_collectives, local_shard
from common.measure.differences import max_over_ranks
from common.measure.memory import storage_bytes
from common.sharding.fsdp import param_groups

__all__ = [
    "backward_outcome",
    "gradient_bytes",
    "one_step_profile",
    "one_backward",
    "train_sharded",
    "one_process",
    "world_of_one",
    "check_fsdp2_options",
]


def backward_outcome(build, x: torch.Tensor, y: torch.Tensor) -> str:
    """`build()` a model, one forward and backward: "ran, gradients on <device type>", or the error raised."""
    try:
        model = build()
        F.cross_entropy(model(x), y).backward()
        return f"ran, gradients on {next(model.parameters()).grad.device.type}"
    except Exception as e:  # the behaviour of this build is the value
        return f"{type(e).__name__}: {e}"


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of the gradients `model` holds on this rank, each storage once: each parameter's `.grad` (a
    DTensor: its local shard) and, for each FSDP2 unit, the unsharded gradients it accumulates while
    `set_requires_gradient_sync(False)` (on its FSDPParam objects: `unsharded_param.grad`, or
    `unsharded_accumulated_grad` when reduce_dtype differs from param_dtype)."""
    grads = [local_shard(p.grad) for p in model.parameters() if p.grad is not None]
    for group in param_groups(model):
        for fp in group.fsdp_params:
            unsharded = getattr(fp, "_unsharded_param", None)
            grads += [
                unsharded.grad if unsharded is not None else None,
                fp.unsharded_accumulated_grad,
            ]
    return storage_bytes(grads)


def one_step_profile(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mine) -> dict:
    """One forward and backward on this rank's slice `mine(x)[0]`: the all-gathers (all of them, and those in
    groups smaller than the world), and the parameter bytes the model holds between forward and backward.

    After forward FSDP2 registers on each module what it then holds: the sharded DTensor
    (reshard_after_forward=True), the gathered tensor (False) or a DTensor sharded over k ranks (an int k).
    """
    with count_collectives() as c:
        loss = F.cross_entropy(model(mine(x)[0]), mine(y)[0])
        params = storage_bytes(local_shard(p) for p in model.parameters())
        loss.backward()
    world, params = dist.get_world_size(), max_over_ranks(params)  # the most any rank holds
    small = sum(
        v
        for (op, ranks), v in c.groups.items()
        if op.startswith("all_gather") and len(ranks) < world
    )
    return {
        "all_gathers": c.calls.get("all_gather_single", 0),
        "in_smaller_groups": small,
        "params": int(params),
    }


def one_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[list, dict]:
    """One forward and backward on (x, y): the gradients in full (every rank calls it), and {op: bytes} of
    the collectives with "grad_dtype", the dtype(s) of the gradients the parameters hold."""
    with count_collectives() as c:
        F.cross_entropy(model(x), y).backward()
    grads = [
        p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        for p in model.parameters()
    ]
    dtype = {
        str(p.grad.dtype).removeprefix("torch.") for p in model.parameters() if p.grad is not None
    }
    return grads, {**c.bytes, "grad_dtype": ",".join(sorted(dtype))}


def train_sharded(
    model: nn.Module, batches: list, mine, lr: float, micro: int = 1, sync_each: bool = False
) -> None:
    """SGD, a step per global batch (x, y) of `batches`, each on this rank's slice `mine(x, micro)` cut into
    `micro` micro-batches (loss / micro); with micro > 1 gradient sync only on the last one (or `sync_each`)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)  # on DTensors: updates the local shards
    for x, y in batches:
        for i, (xm, ym) in enumerate(zip(mine(x, micro), mine(y, micro))):
            if micro > 1:  # reduce-scatter only after the last micro-step's backward
                model.set_requires_gradient_sync(sync_each or i == micro - 1)
            (F.cross_entropy(model(xm), ym) / micro).backward()
        opt.step()
        opt.zero_grad()


def one_process(model: nn.Module, batches: list, lr: float) -> list[torch.Tensor]:
    """The reference: one model, an SGD step on each whole global batch (every rank computing it alike)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def world_of_one() -> None:
    """Plain `python`: FSDP2 needs a process group, so make a world of one (what torchrun would set)."""
    if "RANK" not in os.environ:
        port = str(29400 + os.getpid() % 1000)
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)


def check_fsdp2_options(args, n: int, dtypes: dict) -> None:
    """Lesson 14's options on a world of n ranks, the same numbers on every rank before any process group
    (every rank fails alike): LessonError naming the bad one; fills in --replicate (HSDP replicas: 2 where
    n >= 4 is even, else 1) and --reshard-int (reshard_after_forward=k: n // 2 where that properly divides
    n, else the largest proper divisor, 0 if none)."""
    sizes = (args.width, args.depth, args.steps, args.global_batch, args.micro_steps, args.lr)
    if min(sizes) <= 0 or min(args.depth, args.micro_steps) < 2:  # a next block; micro-steps
        raise LessonError(
            "--width, --steps, --global-batch, --lr: > 0; --depth, --micro-steps: >= 2"
        )
    if args.param_dtype not in dtypes:
        raise LessonError(f"unknown --param-dtype {args.param_dtype!r}: choose bf16 or fp16")
    args.replicate = args.replicate or (2 if n >= 4 and n % 2 == 0 else 1)
    if args.replicate < 1 or n % args.replicate:
        raise LessonError(f"--replicate {args.replicate} does not divide the world of {n} ranks")
    if args.global_batch % (n * args.micro_steps):
        raise LessonError(f"--global-batch {args.global_batch} is not {n} x {args.micro_steps} x b")
    divisors = [k for k in range(2, n) if n % k == 0]
    if not args.reshard_int:  # half the world where that is a proper divisor, else the largest one
        args.reshard_int = n // 2 if n // 2 in divisors else max(divisors, default=0)
    if args.reshard_int and args.reshard_int not in divisors:
        raise LessonError(f"--reshard-int {args.reshard_int} must divide {n}, in 2 .. {n - 1}")
