"""Gradient accumulation under DDP, measured (lesson 07): the batch arithmetic (k micro-steps of micro_batch
samples on world_size ranks make one global batch), one optimizer step of each variant from the same start
against one SGD step on the global batch, and a one-process replay of the training loop.

`Proof.run` resets the model and the all-reduce counter (a comm hook counting buckets), runs a variant (a
function `variant(model, micro_batches)` that leaves the accumulated gradient in `.grad`) and takes one SGD step;
`Proof.check` compares the gradients and parameters with the reference step, worst over ranks, and records the
variant's claims: within TOL (a right variant) or moved by >= 100 x TOL (a wrong one), and its all-reduce calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.data_parallel.micro_batches import micro_batch_stream
from common.harness.env import LessonError
from common.harness.results import Report
from common.measure.differences import max_abs_diff_all, max_over_ranks, nan_max
from common.models import ResidualMLP

__all__ = [
    "TOL",
    "grad_accum_steps_for",
    "checked_grad_accum_steps",
    "draw_global_batch",
    "Proof",
    "replay_accumulation",
    "uneven_sizes",
]

TOL = 1e-5  # float32 rounding of sums taken in another order (measured: ~1e-8)


def uneven_sizes(n: int, k: int) -> list[int]:
    """Split n samples into k micro-batches of DIFFERENT sizes (all >= 1 when n >= k): [n-k+1, 1, 1, ...]."""
    return [n - (k - 1)] + [1] * (k - 1) if k > 1 else [n]


def grad_accum_steps_for(global_batch: int, micro_batch: int, world_size: int) -> int:
    """k such that k x micro_batch x world_size = global_batch. Raises LessonError: not positive or not
    divisible."""
    if global_batch < 1 or micro_batch < 1:
        raise LessonError(
            f"--global-batch and --micro-batch must be positive, got {global_batch} and "
            f"{micro_batch}"
        )
    per_round = micro_batch * world_size
    if global_batch % per_round:
        raise LessonError(
            f"--global-batch {global_batch} is not divisible by --micro-batch x world_size = "
            f"{micro_batch} x {world_size} = {per_round}"
        )
    return global_batch // per_round


def checked_grad_accum_steps(args, world_size: int) -> int:
    """k from --global-batch, --micro-batch and --grad-accum-steps (any two fix the third); raises LessonError
    for a combination that does not fit, or one under which a wrong variant would equal the right one."""
    if args.grad_accum_steps is not None and args.grad_accum_steps <= 0:
        raise LessonError(
            f"--grad-accum-steps must be a positive integer, got {args.grad_accum_steps}"
        )
    if args.global_batch is None:
        k = args.grad_accum_steps
        args.global_batch = 16 if k is None else k * args.micro_batch * world_size
    k = grad_accum_steps_for(args.global_batch, args.micro_batch, world_size)
    if args.grad_accum_steps not in (None, k):
        raise LessonError(
            f"--grad-accum-steps {args.grad_accum_steps} disagrees with --global-batch "
            f"{args.global_batch} / (--micro-batch {args.micro_batch} x world_size "
            f"{world_size}) = {k}"
        )
    if k < 2 or args.steps < 20 or args.lr <= 0 or args.clip <= 0:  # k = 1: wrong equals right
        raise LessonError(
            f"need grad_accum_steps >= 2 (got {k}; raise --global-batch), --steps >= 20 (got "
            f"{args.steps}; the loss is reported every 10 steps), --lr > 0 and --clip > 0"
        )
    if args.micro_batch < 2:  # k samples in k micro-batches are 1 each: no uneven split exists
        raise LessonError(
            f"need --micro-batch >= 2 (got {args.micro_batch}): section 2 splits a rank's "
            "samples into micro-batches of different sizes"
        )
    return k


def draw_global_batch(
    train_set, k: int, micro_batch: int, seed: int, info
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The global batch of k x micro_batch x world_size samples every rank draws alike (from `seed` + 1):
    x (G, 1, 8, 8), y (G,) on info.device, and this rank's k index tensors (micro_batch,) into it: rank r's
    micro-step j holds samples (j W + r) m ... + m (lessons 07 and 23)."""
    W, m = info.world_size, micro_batch
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randperm(len(train_set), generator=g)[: k * m * W]
    gx, gy = train_set.tensors[0][idx].to(info.device), train_set.tensors[1][idx].to(info.device)
    mine = [torch.arange((j * W + info.rank) * m, (j * W + info.rank + 1) * m) for j in range(k)]
    return gx, gy, mine


class Proof:
    """One optimizer step of each variant from `init_state`, against the reference step(s) `ref` (no clip) and
    `ref_clip` (clipped), which the caller sets from `run` on the global batch."""

    def __init__(self, model, raw_model, init_state, counter, args, info, report: Report):
        self.model, self.raw_model = model, raw_model
        self.init_state, self.counter = init_state, counter
        self.args, self.info, self.report = args, info, report  # args: lr, grad_accum_steps
        self.ref = self.ref_clip = None

    def run(self, variant, batches, clip=None, on=None):
        """(gradients, parameters after one SGD step, all-reduce calls, all-reduce bytes) of `variant` on
        `batches`, run on `on` (default: the DDP model); `clip`: clip the gradient norm once, before the step."""
        raw_model = self.raw_model
        raw_model.load_state_dict(self.init_state)
        self.counter.reset()
        variant(self.model if on is None else on, batches)
        grads = [p.grad.detach().clone() for p in raw_model.parameters()]
        if clip is not None:  # once, after the synchronising backward: the global gradient's norm
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), clip)
        torch.optim.SGD(raw_model.parameters(), lr=self.args.lr).step()
        raw_model.zero_grad(set_to_none=True)
        params = [p.detach().clone() for p in raw_model.parameters()]
        return grads, params, self.counter.calls, self.counter.bytes

    def check(self, name, variant, batches, right: bool | None, clip=None, calls=None):
        """right: True (within TOL), False (moves the parameters), None (measured, claimed by the caller).
        `calls`: the all-reduce calls it must make (claimed under DDP only). Returns (gradient, parameter)
        differences from the reference, worst over ranks."""
        grads, params, n_calls, _ = self.run(variant, batches, clip)
        ref = self.ref_clip if clip else self.ref
        g, p = (max_over_ranks(max_abs_diff_all(a, b)) for a, b in zip((grads, params), ref))
        line = "  {variant:<24} {value:.1e}"
        if right:
            self.report.claim(
                f"{name}_equals_global_step", nan_max([g, p]), "<=", TOL, line, variant=name
            )
        elif right is False:
            self.report.claim(f"{name}_changes_the_step", p, ">=", 100 * TOL, line, variant=name)
        if calls is not None and self.info.distributed:
            self.report.claim(
                f"{name}_allreduce_calls",
                n_calls,
                "==",
                calls,
                "  {variant:<24} {value} calls",
                variant=name,
            )
        return g, p


def replay_accumulation(train_set, init_state, args, world_size: int, device) -> list[torch.Tensor]:
    """Lesson 07's training run in ONE process, no accumulation: each step, one forward over every rank's k
    micro-batches (args: micro_batch, grad_accum_steps, steps, lr, clip, seed). Returns the parameters."""
    model = ResidualMLP().to(device)
    model.load_state_dict(init_state)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    streams = [
        micro_batch_stream(train_set, args.micro_batch, world_size, r, args.seed)
        for r in range(world_size)
    ]
    for _ in range(args.steps):
        chunks = [next(s) for s in streams for _ in range(args.grad_accum_steps)]
        x = torch.cat([c[0] for c in chunks]).to(device)  # (global_batch, 1, 8, 8)
        y = torch.cat([c[1] for c in chunks]).to(device)
        F.cross_entropy(model(x), y).backward()  # the mean over the global batch
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach() for p in model.parameters()]
