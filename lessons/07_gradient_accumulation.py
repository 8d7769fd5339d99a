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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from common.data import digits_split
from common.data_parallel.accumulation import (
    TOL,
    Proof,
    checked_grad_accum_steps,
    draw_global_batch,
    replay_accumulation,
    uneven_sizes,
)
from common.data_parallel.micro_batches import micro_batch_stream, no_sync_unless
from common.harness.env import DistInfo, read_torchrun_env
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
from common.measure.differences import max_abs_diff_all, max_over_ranks
from common.measure.memory import storage_bytes
from common.measure.precision import PRECISIONS, autocast_context
from common.models import ResidualMLP
from common.performance.buckets import predicted_buckets


@dataclass
class Run:
    """What every section shares: the options, this rank, the report, the model (`model` is the DDP wrapper
    under torchrun, `raw_model` the ResidualMLP inside), its initial weights, the all-reduce counter, the
    digits, and the global batch every rank draws, with this rank's k micro-batches of it."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    model: torch.nn.Module
    raw_model: ResidualMLP
    init_state: dict
    counter: CommCounter
    train_set: TensorDataset  # (1438, 1, 8, 8), every rank
    test_set: TensorDataset  # (359, 1, 8, 8)
    gx: torch.Tensor  # (G, 1, 8, 8): the global batch, the same on every rank
    gy: torch.Tensor  # (G,)
    mine: list  # k index tensors (m,): micro-step j holds samples (j*W + rank)*m ... + m

    @property
    def micro(self) -> list:
        """This rank's k micro-batches of the global batch: (x (m, 1, 8, 8), y (m,)) each."""
        return [(self.gx[i], self.gy[i]) for i in self.mine]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--global-batch", type=int, default=None, help="samples per optimizer step (16)")
    p.add_argument(
        "--micro-batch", type=int, default=2, help="samples per rank per forward/backward"
    )
    p.add_argument("--grad-accum-steps", type=int, default=None, help="k (default: from the above)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps of the training run")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate; momentum 0.9")
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm, once per step")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="fp16: + GradScaler")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="digits .npz (default: data/digits.npz)")
    p.add_argument("--results", default=None, help="rank 0 writes the numbers here as JSON")
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validate before any process group exists: every rank fails alike, nobody waits in a collective.
    args.grad_accum_steps = checked_grad_accum_steps(args, read_torchrun_env()[2])
    return args


# ------------------------------------------------------------------------------------ 1. the pattern to copy
def accumulate(model, micro_batches) -> None:
    """Forward + backward of this rank's k micro-batches; .grad ends as the global batch's mean gradient."""
    k = len(micro_batches)
    for micro_step, (x, y) in enumerate(micro_batches):
        # no_sync() holds the forward too: DDP arms its reducer in forward when gradient sync is on.
        with no_sync_unless(model, last=micro_step == k - 1):
            # / k: backward ADDS into .grad; k means sum to k x mean
            loss = F.cross_entropy(model(x), y) / k
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


def one_round(run: Run, proof: Proof) -> tuple[int, float]:
    """Section 1: the references, and the pattern against them; returns (calls of one all-reduce round, the
    clip that acts: half the global gradient's norm)."""
    # DDP rebuilds its buckets after the first synchronised backward: warm up once, then count one round.
    proof.run(accumulate, run.micro[:1])
    round_calls, round_bytes = proof.run(accumulate, run.micro[:1])[2:]
    # the reference: one forward on the global batch, no DDP
    proof.ref = proof.run(accumulate, [(run.gx, run.gy)], on=run.raw_model)
    clip = 0.5 * torch.linalg.vector_norm(torch.cat([t.flatten() for t in proof.ref[0]])).item()
    proof.ref_clip = proof.run(accumulate, [(run.gx, run.gy)], clip, on=run.raw_model)
    print0(
        "\n1. accumulated micro-steps vs one SGD step on the global batch: max |difference| over ranks"
    )
    proof.check("accumulate", accumulate, run.micro, True, calls=round_calls)
    if run.info.distributed:
        run.report.claim(
            "buckets",
            round_calls,
            "==",
            predicted_buckets(run.model),
            "  one all-reduce round = {value} bucket all-reduces, as DDP's bucketing rule predicts ...",
        )
        # with the default bucket_cap_mb: a first bucket of 1 MiB, then up to 25 MiB
        run.report.claim(
            "bucket_bytes_equal_parameter_bytes",
            round_bytes,
            "==",
            storage_bytes(run.raw_model.parameters()),
            "  ... of {value} bytes, each parameter's gradient once (buckets of 1, then 25 MiB)",
        )
    return round_calls, clip


def other_variants(run: Run, proof: Proof, round_calls: int) -> None:
    """Section 2: the other right ways, the wrong scalings, and uneven micro-batches."""
    k = run.args.grad_accum_steps
    print0("\n2. other variants: right ones within 1e-5, wrong ones move the parameters by >= 1e-3")
    if run.info.distributed:
        proof.check(
            "require_grad_sync", accumulate_require_grad_sync, run.micro, True, calls=round_calls
        )
        proof.check("always_sync", accumulate_always_sync, run.micro, True, calls=k * round_calls)
        proof.check(
            "backward_only_no_sync",
            accumulate_backward_only_no_sync,
            run.micro,
            True,
            calls=k * round_calls,
        )
    proof.check("no_divide", accumulate_no_divide, run.micro, False)
    proof.check("running_divide", accumulate_running_divide, run.micro, False)
    # The same samples split [n-k+1, 1, 1, ...]: mean / k overweights the lone samples; sum / samples is
    # exact.
    local_idx = torch.cat(run.mine)
    sizes = run.report.value(
        "uneven_sizes", uneven_sizes(len(local_idx), k), "  uneven micro-batch sizes {value}:"
    )
    uneven = [(run.gx[c], run.gy[c]) for c in torch.split(local_idx, sizes)]
    proof.check("uneven_mean_over_k", accumulate, uneven, False)
    proof.check("uneven_sample_weighted", accumulate_sample_weighted, uneven, True)


def clip_variants(run: Run, proof: Proof, clip: float) -> None:
    """Section 2, end: clipping once after the sync, at each micro-step, and hiding a missing / k."""
    k = run.args.grad_accum_steps
    run.report.value(
        "proof_clip", clip, "  with clipping at {value:.4f} = half the global gradient norm:"
    )
    proof.check("clip_after_sync", accumulate, run.micro, True, clip)
    acted: list[bool] = []
    each = functools.partial(accumulate_clip_each_micro_step, clip=clip, acted=acted)
    g, p = proof.check("clip_each_micro_step", each, run.micro, None, clip)
    # The mistake shows only if the clip cut a partial gradient before the last micro-step (with k = 2 and
    # small micro-batches the half-sum can stay under it); otherwise both variants clip the same sum. A
    # barely-cut partial sum moves the step less than the other mistakes do (7.4e-4 at --micro-batch 2
    # --global-batch 8), so the bound is the right variants' own (TOL): a wrong step lies outside it.
    line = "  {variant:<24} {value:.1e}"
    if max_over_ranks(float(any(acted))):
        run.report.claim(
            "clip_each_micro_step_changes_the_step",
            p,
            ">=",
            TOL,
            line,
            variant="clip_each_micro_step",
        )
    else:
        run.report.value(
            "clip_each_micro_step_params",
            p,
            line + " (no partial gradient reached the clip before the last micro-step: no claim)",
            variant="clip_each_micro_step",
        )
    g, p = proof.check("no_divide_clip", accumulate_no_divide, run.micro, None, clip)
    # no / k gives k x the gradient; the clip rescales it AND the right one (norm 2 x clip) to norm `clip`,
    # in the same direction: the step comes out right, hiding the mistake while the norm exceeds the clip
    run.report.claim(
        "no_divide_clip_params_equal",
        p,
        "<=",
        TOL,
        "  no_divide + clip: parameters {value:.1e} ({k}x and right gradient both clipped to "
        "{clip:.4f}) ...",
        k=k,
        clip=clip,
    )
    run.report.claim(
        "no_divide_clip_grads_differ",
        g,
        ">=",
        100 * TOL,
        "  ... but the gradients before it differ by {value:.1e}: below the clip, steps are k x too large",
    )


def comm_by_k(run: Run, proof: Proof, round_calls: int) -> None:
    """Section 3: per optimizer step, (k, calls, bytes) with no_sync and (calls, bytes) syncing always."""
    rows = []
    for kk in (1, 2, 4, 8):
        with_no_sync = proof.run(accumulate, run.micro[:1] * kk)[2:]
        always = proof.run(accumulate_always_sync, run.micro[:1] * kk)[2:]
        rows.append((kk, *with_no_sync, *always))
    head = "   k  no_sync: calls      bytes  sync every micro-step: calls      bytes"
    table = [head] + [
        f"  {kk:>2}  {c1:>14} {b1:>10}  {c2:>28} {b2:>10}" for kk, c1, b1, c2, b2 in rows
    ]
    run.report.value(
        "comm_by_k",
        rows,
        "\n3. all-reduce calls and bytes per optimizer step of k micro-steps, on each rank:\n{table}",
        table="\n".join(table),
    )
    B = storage_bytes(run.raw_model.parameters())  # one all-reduce round sends each gradient once
    off = sum(r[1:] != (round_calls, B, r[0] * round_calls, r[0] * B) for r in rows)
    run.report.claim(
        "comm_by_k_rows_off",
        off,
        "==",
        0,
        "rows that are not exactly 1 and k rounds of the parameter bytes: {value}",
    )


def train(run: Run) -> None:
    """Section 4: lesson 03's loop with accumulation, the pattern to copy; then its claims."""
    k, W = run.args.grad_accum_steps, run.info.world_size
    run.raw_model.load_state_dict(run.init_state)
    optimizer = torch.optim.SGD(run.raw_model.parameters(), lr=run.args.lr, momentum=0.9)
    # fp16 only: bf16 needs none
    scaler = torch.amp.GradScaler(run.info.device.type, enabled=run.args.precision == "fp16")
    batches = micro_batch_stream(
        run.train_set, run.args.micro_batch, W, run.info.rank, run.args.seed
    )
    run.counter.reset()
    loss_sum, seen, history = 0.0, 0.0, []
    print0(
        f"\n4. training ({run.args.precision}): lesson 03's loop with accumulation, the pattern to copy"
    )
    for step in range(run.args.steps):
        for micro_step in range(k):
            x, y = (t.to(run.info.device) for t in next(batches))  # (m, 1, 8, 8), (m,)
            with no_sync_unless(run.model, last=micro_step == k - 1):  # forward AND backward inside
                with autocast_context(run.info.device, run.args.precision):
                    loss = F.cross_entropy(run.model(x), y)  # mean over this micro-batch
                scaler.scale(loss / k).backward()  # / k: backward adds k means into .grad
            loss_sum, seen = loss_sum + loss.item() * len(y), seen + len(y)
        scaler.unscale_(optimizer)  # once per optimizer step (a no-op when the scaler is disabled)
        # after the sync: the global gradient's norm
        torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), run.args.clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)  # frees .grad memory instead of writing zeros
        if (step + 1) % 10 == 0 or step + 1 == run.args.steps:
            history.append({"step": step + 1, "train_loss": global_mean(loss_sum, seen, run.info)})
            run.report.value(
                "train_loss",
                history[-1]["train_loss"],
                "step {step:>3}  train_loss {value:.4f}",
                step=step + 1,
            )
            loss_sum = seen = 0.0
    run.report.record("history", history)
    run.report.claim(
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
        report = Report(info)
        # (1438, 1, 8, 8) and (359, 1, 8, 8), every rank
        train_set, test_set = digits_split(path=args.data)
        set_seed(args.seed)
        raw_model = ResidualMLP().to(info.device)
        init_state = copy.deepcopy(raw_model.state_dict())
        # .to(device) -> DDP; raw_model is what we read and save. The counter is a comm hook counting buckets.
        model = DDP(raw_model, device_ids=info.device_ids) if info.distributed else raw_model
        counter = CommCounter().register(model) if info.distributed else CommCounter()
        # (G, 1, 8, 8), (G,), and this rank's k index tensors (m,)
        batch = draw_global_batch(train_set, k, m, args.seed, info)
        run = Run(
            args, info, report, model, raw_model, init_state, counter, train_set, test_set, *batch
        )
        sizes = dict(world_size=W, global_batch=G, micro_batch=m, grad_accum_steps=k)
        for name, v in sizes.items():
            report.record(name, v)
        n_params = sum(p.numel() for p in raw_model.parameters())
        report.value(
            "n_params", n_params, "ResidualMLP (width 256, depth 4): {value} fp32 parameters"
        )
        print0(f"global batch {G} = micro_batch {m} x world_size {W} x grad_accum_steps {k}")
        # one SGD step of each variant from init_state, against the reference step set in section 1
        proof = Proof(model, raw_model, init_state, counter, args, info, report)
        round_calls, clip = one_round(run, proof)
        other_variants(run, proof, round_calls)
        clip_variants(run, proof, clip)
        if info.distributed:
            comm_by_k(run, proof, round_calls)
        train(run)
        final_claims(run, round_calls)
        report.finish(args.results)


def final_claims(run: Run, round_calls: int) -> None:
    """After training: one round per step, identical replicas, the test metrics, the one-process replay."""
    if run.info.distributed:
        run.report.claim(
            "train_allreduce_calls_per_step",
            run.counter.calls / run.args.steps,
            "==",
            round_calls,
            "all-reduce calls per optimizer step while training: {value:g} (one round)",
        )
    run.report.claim(
        "max_param_diff_across_ranks",
        max_param_diff_across_ranks(run.raw_model, run.info),
        "==",
        0.0,
        "max parameter difference across ranks {value:.1e}",
    )  # same gradient, same step
    final = evaluate(run.raw_model, run.test_set, run.info)
    run.report.value("final_test_loss", final["loss"], "final test_loss {value:.4f}")
    run.report.value("final_test_accuracy", final["accuracy"], "final test_acc {value:.4f}")
    # the loop itself, against one process on the same global batches (a replay in fp32)
    with rank0_only(run.info, "the one-process replay of the training run") as mine:
        if mine:
            replayed = replay_accumulation(
                run.train_set, run.init_state, run.args, run.info.world_size, run.info.device
            )
            run.report.claim(
                "training_loop_equals_one_process_replay",
                max_abs_diff_all(run.raw_model.parameters(), replayed),
                "<=",
                TOL if run.args.precision == "fp32" else 1e-2,
                "training loop vs a one-process replay of its global batches: {value:.1e} "
                "(1e-2 under autocast)",
            )


if __name__ == "__main__":
    run_main(main)
