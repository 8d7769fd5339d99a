"""Lesson 07: gradient accumulation under DDP -- k micro-steps, one all-reduce round, one optimizer step.

    python lessons/07_gradient_accumulation.py                                    # one process: k = 16/2 = 8
    torchrun --standalone --nproc_per_node=2 lessons/07_gradient_accumulation.py  # 2 ranks: k = 16/(2x2) = 4
    torchrun --standalone --nproc_per_node=4 lessons/07_gradient_accumulation.py  # 4 ranks: k = 2
    # fp16 autocast with a GradScaler
    torchrun --standalone --nproc_per_node=2 lessons/07_gradient_accumulation.py --precision fp16

What to look for (the global batch, 16, defines an optimizer step; k = global_batch / (micro_batch x
world_size)):
1. `accumulate`, the pattern to copy: micro-steps 0..k-2 run forward AND backward inside no_sync(), loss / k,
   one clip after the last backward. It equals one SGD step on the global batch, with one all-reduce round.
2. Each other variant, measured: no_sync() around the backward only still all-reduces every micro-step (README
   myth 8); micro_step + 1 or no divisor changes the step (myth 9); uneven micro-batches need sample weights.
3. All-reduce calls and bytes per optimizer step against k: one round with no_sync(), k rounds without.
4. The training loop (GradScaler and the clip once per optimizer step) equals a one-process replay. Lesson 08:
   memory.

Sources: https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html (no_sync);
https://pytorch.org/docs/stable/notes/amp_examples.html#gradient-accumulation; nanoGPT's train.py,
build-nanogpt.
"""

from __future__ import annotations

import argparse
import copy
import functools

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.data import digits_split
from common.harness.env import LessonError, read_torchrun_env
from common.harness.metrics import evaluate
from common.harness.ranks import global_mean, max_param_diff_across_ranks, print0
from common.harness.results import Report
from common.harness.session import (
    add_distributed_args,
    distributed_session,
    rank0_only,
    run_main,
    set_seed,
)
from common.measure.counters import CommCounter
from common.measure.differences import nan_max
from common.measure.memory import ResidualMLP, micro_batch_stream, no_sync_unless
from common.measure.precision import PRECISIONS, autocast_context, max_diff, worst_over_ranks
from common.performance.buckets import predicted_buckets

TOL = 1e-5  # float32 rounding of sums taken in another order (measured: ~1e-8)


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


def uneven_sizes(n: int, k: int) -> list[int]:
    """Split n samples into k micro-batches of DIFFERENT sizes (all >= 1 when n >= k): [n-k+1, 1, 1, ...]."""
    return [n - (k - 1)] + [1] * (k - 1) if k > 1 else [n]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--global-batch", type=int, default=None, help="samples per optimizer step, all ranks (16)"
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=2,
        help="samples per rank per forward/backward (default 2)",
    )
    p.add_argument(
        "--grad-accum-steps", type=int, default=None, help="k (default: from the global batch)"
    )
    p.add_argument(
        "--steps", type=int, default=40, help="optimizer steps of the training run (default 40)"
    )
    p.add_argument(
        "--lr", type=float, default=0.05, help="SGD learning rate; momentum 0.9 (default 0.05)"
    )
    p.add_argument(
        "--clip", type=float, default=1.0, help="max gradient norm, applied once per optimizer step"
    )
    p.add_argument(
        "--precision", choices=PRECISIONS, default="fp32", help="training run (fp16: + GradScaler)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--data", default=None, help="digits .npz (default: the bundled data/digits.npz)"
    )
    p.add_argument(
        "--results", default=None, help="rank 0 writes the reported numbers here as JSON"
    )
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validate before any process group exists: every rank fails alike, nobody waits in a collective.
    world_size = read_torchrun_env()[2]
    if args.grad_accum_steps is not None and args.grad_accum_steps <= 0:
        raise LessonError(
            f"--grad-accum-steps must be a positive integer, got {args.grad_accum_steps}"
        )
    if args.global_batch is None:
        args.global_batch = (
            16
            if args.grad_accum_steps is None
            else args.grad_accum_steps * args.micro_batch * world_size
        )
    k = grad_accum_steps_for(args.global_batch, args.micro_batch, world_size)
    if args.grad_accum_steps not in (None, k):
        raise LessonError(
            f"--grad-accum-steps {args.grad_accum_steps} disagrees with --global-batch "
            f"{args.global_batch} / (--micro-batch {args.micro_batch} x world_size "
            f"{world_size}) = {k}"
        )
    args.grad_accum_steps = k
    if (
        k < 2 or args.steps < 20 or args.lr <= 0 or args.clip <= 0
    ):  # k = 1: a wrong variant equals the right
        raise LessonError(
            f"need grad_accum_steps >= 2 (got {k}; raise --global-batch), --steps >= 20 (got "
            f"{args.steps}; the loss is reported every 10 steps), --lr > 0 and --clip > 0"
        )
    if (
        args.micro_batch < 2
    ):  # k samples split into k micro-batches are 1 each: no uneven split exists
        raise LessonError(
            f"need --micro-batch >= 2 (got {args.micro_batch}): section 2 splits a rank's "
            "samples into micro-batches of different sizes"
        )
    return args


# ------------------------------------------------------------------------------------ 1. the pattern to copy
def accumulate(model, micro_batches) -> None:
    """Forward + backward of this rank's k micro-batches; .grad ends as the global batch's mean gradient."""
    k = len(micro_batches)
    for micro_step, (x, y) in enumerate(micro_batches):
        # no_sync() holds the forward too: DDP arms its reducer in forward when gradient sync is on.
        with no_sync_unless(model, last=micro_step == k - 1):
            loss = (
                F.cross_entropy(model(x), y) / k
            )  # / k: backward ADDS into .grad; k means sum to k x mean
            loss.backward()


# ------------------------------------------------------------------------- 2. other variants, each measured
def accumulate_require_grad_sync(model, micro_batches) -> None:
    """Right (nanoGPT's way): set the flag no_sync() sets and restores, before each forward."""
    for micro_step, (x, y) in enumerate(micro_batches):
        model.require_backward_grad_sync = micro_step == len(micro_batches) - 1
        (F.cross_entropy(model(x), y) / len(micro_batches)).backward()
    model.require_backward_grad_sync = True


def accumulate_always_sync(model, micro_batches) -> None:
    """Right numbers, k times the communication: every backward all-reduces."""
    for x, y in micro_batches:
        (F.cross_entropy(model(x), y) / len(micro_batches)).backward()


def accumulate_backward_only_no_sync(model, micro_batches) -> None:
    """WRONG: the forward ran outside no_sync() and armed the reducer, so this backward still all-reduces."""
    for micro_step, (x, y) in enumerate(micro_batches):
        loss = F.cross_entropy(model(x), y) / len(micro_batches)
        with no_sync_unless(model, last=micro_step == len(micro_batches) - 1):
            loss.backward()


def accumulate_no_divide(model, micro_batches) -> None:
    """WRONG: the sum of k means is k times the mean gradient."""
    for micro_step, (x, y) in enumerate(micro_batches):
        with no_sync_unless(model, last=micro_step == len(micro_batches) - 1):
            F.cross_entropy(model(x), y).backward()


def accumulate_running_divide(model, micro_batches) -> None:
    """WRONG: loss / (micro_step + 1) weights micro-step i by 1 / (i + 1) instead of 1 / k."""
    for micro_step, (x, y) in enumerate(micro_batches):
        with no_sync_unless(model, last=micro_step == len(micro_batches) - 1):
            (F.cross_entropy(model(x), y) / (micro_step + 1)).backward()


def accumulate_sample_weighted(model, micro_batches) -> None:
    """Right for uneven micro-batches if every rank holds as many samples: summed sample losses / local
    sample count."""
    n_local = sum(len(y) for _, y in micro_batches)
    for micro_step, (x, y) in enumerate(micro_batches):
        with no_sync_unless(model, last=micro_step == len(micro_batches) - 1):
            (F.cross_entropy(model(x), y, reduction="sum") / n_local).backward()


def accumulate_clip_each_micro_step(
    model, micro_batches, clip: float, acted: list | None = None
) -> None:
    """WRONG: clips partial (and, under no_sync, per-rank) gradients; clip the synchronised sum once.
    `acted` (if given) collects whether the clip cut a partial gradient before the last micro-step."""
    for micro_step, (x, y) in enumerate(micro_batches):
        last = micro_step == len(micro_batches) - 1
        with no_sync_unless(model, last=last):
            (F.cross_entropy(model(x), y) / len(micro_batches)).backward()
        params = (model.module if isinstance(model, DDP) else model).parameters()
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        if acted is not None and not last:
            acted.append(bool(norm > clip))


def replay_on_one_process(
    train_set, init_state, args, world_size: int, device
) -> list[torch.Tensor]:
    """Section 4's run in ONE process, no accumulation: each step, one forward over every rank's k
    micro-batches."""
    model = ResidualMLP().to(device)
    model.load_state_dict(init_state)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    streams = [
        micro_batch_stream(train_set, args.micro_batch, world_size, r, args.seed)
        for r in range(world_size)
    ]
    for _ in range(args.steps):
        chunks = [next(s) for s in streams for _ in range(args.grad_accum_steps)]
        x, y = (
            torch.cat([c[0] for c in chunks]).to(device),
            torch.cat([c[1] for c in chunks]).to(device),
        )
        F.cross_entropy(
            model(x), y
        ).backward()  # x (global_batch, 1, 8, 8): the mean over the global batch
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach() for p in model.parameters()]


class Proof:
    """Sections 1-3: one optimizer step of each variant from the same start, against one step on the global
    batch. `run` resets the model and the all-reduce counter (a comm hook counting buckets) and steps; `check`
    compares a variant with the reference and records its claims."""

    def __init__(self, model, raw_model, init_state, counter, args, info, report: Report):
        self.model, self.raw_model, self.init_state, self.counter = (
            model,
            raw_model,
            init_state,
            counter,
        )
        self.args, self.info, self.report = args, info, report
        self.ref = self.ref_clip = None

    def run(self, variant, batches, clip=None, on=None):
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
        """right: True (within TOL), False (moves the parameters), None (measured, claimed by the caller)."""
        grads, params, n_calls, _ = self.run(variant, batches, clip)
        ref = self.ref_clip if clip else self.ref
        g, p = worst_over_ranks([max_diff(a, b) for a, b in zip((grads, params), ref)], self.info)
        if right:
            self.report.claim(
                f"{name}_equals_global_step",
                nan_max([g, p]),
                "<=",
                TOL,
                f"  {name:<24} {{value:.1e}}",
            )
        elif right is False:
            self.report.claim(
                f"{name}_changes_the_step", p, ">=", 100 * TOL, f"  {name:<24} {{value:.1e}}"
            )
        if calls is not None and self.info.distributed:
            self.report.claim(
                f"{name}_allreduce_calls", n_calls, "==", calls, f"  {name:<24} {{value}} calls"
            )
        return g, p


def prove_variants(proof: Proof, micro, mine, gx, gy, param_bytes: int) -> tuple[int, int]:
    """Sections 1 and 2: the pattern and every other variant; returns one all-reduce round (calls, bytes)."""
    info, report, k = proof.info, proof.report, proof.args.grad_accum_steps
    # DDP rebuilds its buckets after the first synchronised backward: warm up once, then count one round.
    proof.run(accumulate, micro[:1])
    round_calls, round_bytes = proof.run(accumulate, micro[:1])[2:]
    # the reference: one forward on the global batch, no DDP
    proof.ref = proof.run(accumulate, [(gx, gy)], on=proof.raw_model)
    clip = (
        0.5 * torch.linalg.vector_norm(torch.cat([t.flatten() for t in proof.ref[0]])).item()
    )  # so it acts
    proof.ref_clip = proof.run(accumulate, [(gx, gy)], clip, on=proof.raw_model)
    print0(
        "\n1. accumulated micro-steps vs one SGD step on the global batch: max |difference| over ranks"
    )
    proof.check("accumulate", accumulate, micro, True, calls=round_calls)
    if info.distributed:
        report.claim(
            "buckets",
            round_calls,
            "==",
            predicted_buckets(proof.model),
            "  one all-reduce round = {value} bucket all-reduces, as DDP's bucketing rule "
            "predicts ...",
        )
        report.claim(
            "bucket_bytes_equal_parameter_bytes",
            round_bytes,
            "==",
            param_bytes,
            "  ... of {value} bytes, each parameter's gradient once (with the default "
            "bucket_cap_mb: a first bucket of 1 MiB, then up to 25 MiB)",
        )
    print0("\n2. other variants: right ones within 1e-5, wrong ones move the parameters by >= 1e-3")
    if info.distributed:
        proof.check(
            "require_grad_sync", accumulate_require_grad_sync, micro, True, calls=round_calls
        )
        proof.check("always_sync", accumulate_always_sync, micro, True, calls=k * round_calls)
        proof.check(
            "backward_only_no_sync",
            accumulate_backward_only_no_sync,
            micro,
            True,
            calls=k * round_calls,
        )
    proof.check("no_divide", accumulate_no_divide, micro, False)
    proof.check("running_divide", accumulate_running_divide, micro, False)
    # The same samples split [n-k+1, 1, 1, ...]: mean / k overweights the lone samples; sum / samples is
    # exact.
    local_idx = torch.cat(mine)
    sizes = report.value(
        "uneven_sizes", uneven_sizes(len(local_idx), k), "  uneven micro-batch sizes {value}:"
    )
    uneven = [(gx[c], gy[c]) for c in torch.split(local_idx, sizes)]
    proof.check("uneven_mean_over_k", accumulate, uneven, False)
    proof.check("uneven_sample_weighted", accumulate_sample_weighted, uneven, True)
    report.value(
        "proof_clip", clip, "  with clipping at {value:.4f} = half the global gradient norm:"
    )
    proof.check("clip_after_sync", accumulate, micro, True, clip)
    acted: list[bool] = []
    g, p = proof.check(
        "clip_each_micro_step",
        functools.partial(accumulate_clip_each_micro_step, clip=clip, acted=acted),
        micro,
        None,
        clip,
    )
    # The mistake shows only if the clip cut a partial gradient before the last micro-step (with k = 2 and
    # small micro-batches the half-sum can stay under it); otherwise both variants clip the same sum. A
    # barely-cut partial sum moves the step less than the other mistakes do (7.4e-4 at --micro-batch 2
    # --global-batch 8), so the bound is the right variants' own (TOL): a wrong step lies outside it.
    cut = worst_over_ranks([float(any(acted))], proof.info)[0]
    if cut:
        report.claim(
            "clip_each_micro_step_changes_the_step",
            p,
            ">=",
            TOL,
            f"  {'clip_each_micro_step':<24} {{value:.1e}}",
        )
    else:
        report.value(
            "clip_each_micro_step_params",
            p,
            f"  {'clip_each_micro_step':<24} {{value:.1e}} (no "
            "partial gradient reached the clip before the last micro-step: no claim)",
        )
    g, p = proof.check("no_divide_clip", accumulate_no_divide, micro, None, clip)
    # no / k gives k x the gradient; the clip rescales it AND the right one (norm 2 x clip) to norm `clip`,
    # in the same direction: the step comes out right, hiding the mistake while the norm exceeds the clip
    report.claim(
        "no_divide_clip_params_equal",
        p,
        "<=",
        TOL,
        f"  no_divide + clip: parameters {{value:.1e}} (the clip scales the {k}x gradient and the "
        f"right one to the same norm {clip:.4f}: the missing / k is hidden) ...",
    )
    report.claim(
        "no_divide_clip_grads_differ",
        g,
        ">=",
        100 * TOL,
        "  ... but the gradients before the "
        "clip differ by {value:.1e}: once the norm falls below the clip, steps are k x too large",
    )
    return round_calls, round_bytes


def comm_by_k(proof: Proof, micro, round_calls: int, param_bytes: int) -> None:
    """Section 3: per optimizer step, (k, calls, bytes) with no_sync and (calls, bytes) syncing always."""
    rows = []
    for kk in (1, 2, 4, 8):
        rows.append(
            (
                kk,
                *proof.run(accumulate, micro[:1] * kk)[2:],
                *proof.run(accumulate_always_sync, micro[:1] * kk)[2:],
            )
        )
    head = (
        f"  {'k':>2}  {'no_sync: calls':>14} {'bytes':>10}  {'sync every micro-step: calls':>28} "
    )
    head += f"{'bytes':>10}"
    table = [head] + [
        f"  {kk:>2}  {c1:>14} {b1:>10}  {c2:>28} {b2:>10}" for kk, c1, b1, c2, b2 in rows
    ]
    proof.report.value(
        "comm_by_k",
        rows,
        "\n3. all-reduce calls and bytes per optimizer step of k "
        "micro-steps, on each rank:\n" + "\n".join(table),
    )
    off = sum(
        r[1:] != (round_calls, param_bytes, r[0] * round_calls, r[0] * param_bytes) for r in rows
    )
    proof.report.claim(
        "comm_by_k_rows_off",
        off,
        "==",
        0,
        "rows that are not exactly 1 and k rounds of the parameter bytes: {value}",
    )


def train(model, raw_model, init_state, counter, train_set, args, info, report: Report) -> None:
    """Section 4: lesson 03's loop with accumulation, the pattern to copy; then its claims."""
    dev, k, W = info.device, args.grad_accum_steps, info.world_size
    raw_model.load_state_dict(init_state)
    optimizer = torch.optim.SGD(raw_model.parameters(), lr=args.lr, momentum=0.9)
    scaler = torch.amp.GradScaler(
        dev.type, enabled=args.precision == "fp16"
    )  # fp16 only: bf16 needs none
    batches = micro_batch_stream(train_set, args.micro_batch, W, info.rank, args.seed)
    counter.reset()
    loss_sum, seen, history = 0.0, 0.0, []
    print0(
        f"\n4. training ({args.precision}): lesson 03's loop with accumulation, the pattern to copy"
    )
    for step in range(args.steps):
        for micro_step in range(k):
            x, y = (t.to(dev) for t in next(batches))  # (m, 1, 8, 8), (m,)
            with no_sync_unless(model, last=micro_step == k - 1):  # forward AND backward inside
                with autocast_context(dev, args.precision):
                    loss = F.cross_entropy(model(x), y)  # mean over this micro-batch
                scaler.scale(loss / k).backward()  # / k: backward adds k means into .grad
            loss_sum, seen = loss_sum + loss.item() * len(y), seen + len(y)
        scaler.unscale_(optimizer)  # once per optimizer step (a no-op when the scaler is disabled)
        torch.nn.utils.clip_grad_norm_(
            raw_model.parameters(), args.clip
        )  # after sync: the global gradient
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)  # frees .grad memory instead of writing zeros
        if (step + 1) % 10 == 0 or step + 1 == args.steps:
            history.append({"step": step + 1, "train_loss": global_mean(loss_sum, seen, info)})
            report.value(
                "train_loss",
                history[-1]["train_loss"],
                f"step {step + 1:>3}  train_loss {{value:.4f}}",
            )
            loss_sum = seen = 0.0
    report.record("history", history)
    report.claim(
        "train_loss_falls",
        history[0]["train_loss"] - history[-1]["train_loss"],
        ">=",
        0.2,
        "train_loss fell by {value:.3f} from the first report to the last",
    )


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        W, k, m, G = info.world_size, args.grad_accum_steps, args.micro_batch, args.global_batch
        dev = info.device
        report = Report(info)
        train_set, test_set = digits_split(
            path=args.data
        )  # (1438, 1, 8, 8) and (359, 1, 8, 8), every rank
        set_seed(args.seed)
        raw_model = ResidualMLP().to(dev)
        init_state = copy.deepcopy(raw_model.state_dict())
        # .to(device) -> DDP; raw_model is what we read and save. The counter is a comm hook counting buckets.
        model = raw_model
        if info.distributed:
            model = DDP(raw_model, device_ids=[info.local_rank] if dev.type == "cuda" else None)
        counter = CommCounter().register(model) if info.distributed else CommCounter()
        param_bytes = sum(p.numel() * p.element_size() for p in raw_model.parameters())
        report.results.update(world_size=W, global_batch=G, micro_batch=m, grad_accum_steps=k)
        report.value(
            "n_params",
            param_bytes // 4,
            f"ResidualMLP (width 256, depth 4): {{value}} fp32 "
            f"parameters; global batch {G} = micro_batch {m} x world_size {W} x grad_accum_steps "
            f"{k}",
        )
        # Every rank draws the same global batch; rank r's micro-step j holds samples (j*W + r)*m ... + m.
        idx = torch.randperm(
            len(train_set), generator=torch.Generator().manual_seed(args.seed + 1)
        )[:G]
        gx, gy = (
            train_set.tensors[0][idx].to(dev),
            train_set.tensors[1][idx].to(dev),
        )  # (G, 1, 8, 8), (G,)
        mine = [
            torch.arange((j * W + info.rank) * m, (j * W + info.rank + 1) * m) for j in range(k)
        ]
        micro = [(gx[i], gy[i]) for i in mine]
        proof = Proof(model, raw_model, init_state, counter, args, info, report)
        round_calls, _ = prove_variants(proof, micro, mine, gx, gy, param_bytes)
        if info.distributed:
            comm_by_k(proof, micro, round_calls, param_bytes)
        train(model, raw_model, init_state, counter, train_set, args, info, report)
        if info.distributed:
            report.claim(
                "train_allreduce_calls_per_step",
                counter.calls / args.steps,
                "==",
                round_calls,
                "all-reduce calls per optimizer step while training: {value:g} (one round)",
            )
        report.claim(
            "max_param_diff_across_ranks",
            max_param_diff_across_ranks(raw_model, info),
            "==",
            0.0,
            "max parameter difference across ranks {value:.1e}",
        )  # same gradient, same step
        final = evaluate(raw_model, test_set, info)
        report.value("final_test_loss", final["loss"], "final test_loss {value:.4f}")
        report.value("final_test_accuracy", final["accuracy"], "final test_acc {value:.4f}")
        with rank0_only(info, "the one-process replay of the training run") as mine:
            if (
                mine
            ):  # the loop itself, against one process on the same global batches (a replay in fp32)
                replayed = replay_on_one_process(train_set, init_state, args, W, dev)
                diff = max_diff(raw_model.parameters(), replayed)
                report.claim(
                    "training_loop_equals_one_process_replay",
                    diff,
                    "<=",
                    TOL if args.precision == "fp32" else 1e-2,
                    "training loop vs a one-process "
                    "replay of its global batches: {value:.1e} (bound 1e-5 in fp32, 1e-2 under "
                    "autocast)",
                )
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
