"""Lesson 05: uneven data -- evaluation without padding, Join for uneven shards, per-rank random streams.

    python lessons/05_uneven_data.py                                    # one process (world of 1)
    torchrun --standalone --nproc_per_node=2 lessons/05_uneven_data.py  # 2 processes: the failures need 2

What to look for:
1. Evaluation: UnpaddedDistributedSampler gives ranks 180 and 179 of 359 test images; (loss_sum, correct,
   count) summed over ranks, divided once, equals one process and common.harness.metrics.evaluate (padding
   counted: 360). Evaluate the UNWRAPPED model: with 1 image on 2 ranks, rank 1's shard is empty, and through
   the DDP wrapper rank 0's forward broadcasts buffers (BatchNorm statistics) that rank 1 never joins, until
   the timeout (2 s here).
2. Join: rank r holds 4 + r batches. Under `Join([model])` every rank finishes, after 4 and 5 steps, with
   identical parameters: a rank that ran out shadows DDP's collectives. Without Join, rank 1 waits in its
   5th gradient all-reduce until the timeout. Join covers ONLY the collectives of the objects it wraps (DDP,
   ZeroRedundancyOptimizer): a `dist.all_reduce(loss)` of yours inside the loop meets the finished rank's
   shadow collectives and gloo fails ("Received data size doesn't match expected size"; the process aborts:
   shown in a child world). Reduce (loss_sum, count) after the loop, or agree on a step count first
   (all-reduce MIN of the batch counts) and need no Join. There is always a timeout: 30 min for gloo, 10 min
   for NCCL, where a timed-out collective does not raise: the watchdog tears the process down
   (TORCH_NCCL_ASYNC_ERROR_HANDLING 1, torchrun's, or 3, the default; 2 only aborts the communicators).
   So the failure demos run on CPU with gloo, in groups of their own with a short timeout.
3. Seeding (myth 6). PyTorch already seeds torch, numpy and random differently in each worker of one rank;
   what goes wrong is the same seed on every rank: worker w on rank 0 repeats worker w on rank 1 (k workers),
   and with 0 workers (the default) the draws come from the global RNGs, alike on every rank, which a
   DataLoader generator does not reach. seed_data_rngs(seed, rank) (common/data_parallel/seeding.py), called
   after the model is built, re-seeds the global RNGs per rank and returns loader_generator(seed, rank): both
   cases differ by rank and reproduce on a rerun. A DataLoader draws a base seed every epoch; with
   persistent_workers, once in all.

Sources: https://pytorch.org/docs/stable/distributed.algorithms.join.html;
.../distributed.html#torch.distributed. init_process_group (timeout);
.../data.html#randomness-in-multi-process-data-loading; torch/csrc/distributed/c10d/ ProcessGroupNCCL.hpp
(kProcessGroupNCCLDefaultTimeout, TORCH_NCCL_ASYNC_ERROR_HANDLING: GPU-only, cited).
"""

from __future__ import annotations

import argparse
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from common.data import digits_split
from common.data_parallel.samplers import UnpaddedDistributedSampler
from common.data_parallel.seeding import describe_pairs, distinct_streams, seeding_demo
from common.exhibits.uneven import (
    all_reduce_inside_join,
    all_reduce_inside_join_child,
    ddp_eval_with_empty_shard,
    train_without_join,
)
from common.harness.env import DistInfo, LessonError
from common.harness.metrics import evaluate, one_process_eval, shard_sums
from common.harness.ranks import (
    all_gather_objects,
    all_reduce_sum,
    max_param_diff_across_ranks,
    print0,
)
from common.harness.results import Report
from common.harness.session import (
    add_distributed_args,
    distributed_session,
    rank0_only,
    run_main,
    set_seed,
)
from common.models import DigitsCNN


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0, help="model init, data order, augmentations")
    p.add_argument("--join-batches", type=int, default=4, help="rank r trains on this + r batches")
    p.add_argument("--batch-size", type=int, default=16, help="samples per batch per process")
    p.add_argument("--hang-timeout-s", type=float, default=2.0, help="failure demos' timeout (s)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers in the seeding demo")
    p.add_argument("--aug-samples", type=int, default=8, help="samples per rank, seeding demo")
    p.add_argument("--data", default=None, help="digits .npz (default: data/digits.npz)")
    p.add_argument("--results", default=None, help="rank 0 writes the numbers here as JSON")
    # section 2's child world
    p.add_argument("--child", choices=["all-reduce-in-join"], help=argparse.SUPPRESS)
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validate before any process group exists: every rank sees the same argv, so every rank fails alike.
    minimum = {"join_batches": 1, "batch_size": 1, "workers": 1, "aug_samples": 1, "seed": 0}
    for name, low in minimum.items():
        if getattr(args, name) < low:
            what = "a positive integer" if low else ">= 0"
            flag = "--" + name.replace("_", "-")
            raise LessonError(f"{flag} must be {what}, got {getattr(args, name)}")
    # worker w loads sample w first: fewer samples leave workers without a stream
    if args.aug_samples < args.workers:
        raise LessonError(
            f"--aug-samples must be >= --workers ({args.workers}), got {args.aug_samples}"
        )
    if not 0.0 < args.hang_timeout_s < args.timeout_s:
        raise LessonError(
            f"--hang-timeout-s must be in (0, --timeout-s={args.timeout_s}), "
            f"got {args.hang_timeout_s}"
        )
    return args


@dataclass
class Run:
    """What the sections share: options, rank, report, the digits splits, and the model every rank starts
    from, unwrapped and as it trains (DDP with 2+ ranks; the same module in one process)."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    train_set: TensorDataset  # (1438, 1, 8, 8) images, (1438,) labels
    test_set: TensorDataset  # (359, 1, 8, 8), (359,)
    raw_model: DigitsCNN
    model: torch.nn.Module  # DDP(raw_model), or raw_model itself


# 1. Evaluation without padding ------------------------------------------------------------------------------
def evaluate_unpadded(raw_model, dataset, info) -> dict:
    """The code to copy: each rank its unpadded shard, the UNWRAPPED model, (sum, count) reduced,
    divided once."""
    sampler = UnpaddedDistributedSampler(dataset, info.world_size, info.rank)
    mine = shard_sums(raw_model, dataset, sampler, info.device)
    loss_sum, correct, count = all_reduce_sum(mine, info)  # an empty shard joins it too
    return {
        "loss": loss_sum / count,
        "accuracy": correct / count,
        "count": int(count),
        "shard": int(mine[2]),
    }


def padding_counted_as_data(model, dataset, info) -> int:
    """The mistake: DistributedSampler's padding repeats counted as samples; returns the count it
    divides by."""
    sampler = DistributedSampler(dataset, info.world_size, info.rank, shuffle=False)
    return int(all_reduce_sum(shard_sums(model, dataset, sampler, info.device), info)[2])


# 2. Uneven shards: Join -------------------------------------------------------------------------------------
def train_with_join(model, raw_model, loader, info) -> dict:
    """The code to copy: Join around the loop, no collective of your own inside it, metrics reduced
    after it."""
    # Plain SGD: Join keeps parameters in sync, not optimizer state (momentum would differ on the rank that
    # stopped).
    optimizer = torch.optim.SGD(raw_model.parameters(), lr=0.05)
    steps, loss_sum, count = 0, 0.0, 0
    with Join([model]) if info.distributed else nullcontext():
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(info.device)), y.to(info.device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps, loss_sum, count = steps + 1, loss_sum + loss.item() * len(y), count + len(y)
    loss_sum, count = all_reduce_sum([loss_sum, count], info)  # after the loop: every rank joins
    return {"steps": steps, "loss": loss_sum / count, "count": int(count)}


def uneven_loader(run: Run) -> DataLoader:
    """Rank r's join_batches + r batches, as when each rank reads its own shard file and the files differ."""
    W, r, b = run.info.world_size, run.info.rank, run.args.batch_size
    sampler = DistributedSampler(run.train_set, W, r, seed=run.args.seed)  # shuffled
    mine = list(sampler)[: (run.args.join_batches + r) * b]
    return DataLoader(Subset(run.train_set, mine), b)


def evaluation(run: Run) -> None:
    """1. Evaluation of the (untrained, accuracy about 0.1) model: the exact ways must agree."""
    print0(f"\n1. Evaluation on {len(run.test_set)} test images")
    ev = evaluate_unpadded(run.raw_model, run.test_set, run.info)
    run.report.claim(
        "unpadded_counts_every_image_once",
        ev["count"],
        "==",
        len(run.test_set),
        "  UnpaddedDistributedSampler shards {shards}, (sum, count) reduced: {value} images",
        shards=run.report.record("eval_shards", all_gather_objects(ev["shard"], run.info)),
    )
    # one process, the whole test set: the reference; logits (359, 10)
    single, logits = one_process_eval(run.raw_model, run.test_set, run.info.device)
    # evaluated BEFORE training: loss about ln 10 = 2.303 and accuracy about 0.1 are chance on 10 digits
    run.report.value(
        "eval_unpadded",
        {k: ev[k] for k in ("loss", "accuracy", "count")},
        "  the untrained model (no step yet, 10 classes): loss {value[loss]:.6f} (ln 10 = 2.3026)"
        "  accuracy {value[accuracy]:.6f} (chance: 0.1)",
    )
    references = {
        "one_process": single,
        "metrics_evaluate": evaluate(run.raw_model, run.test_set, run.info),
    }
    for name, other in references.items():
        for key, bound in (("loss", 1e-5), ("accuracy", 1e-12)):
            run.report.claim(
                f"unpadded_equals_{name}_{key}",
                abs(ev[key] - other[key]),
                "<=",
                bound,
                "  |{key} - {ref} {key}| = {value:.1e}",
                key=key,
                ref=name,
            )
    W = run.info.world_size
    run.report.claim(
        "padding_counted_as_data",
        padding_counted_as_data(run.raw_model, run.test_set, run.info),
        "==",
        W * -(-len(run.test_set) // W),
        "  DistributedSampler's padding counted as data: {value} images",
    )
    one_image(run, logits)


def one_image(run: Run, logits: torch.Tensor) -> None:
    """1, continued: 1 test image (with 2 ranks, rank 1's shard is empty), unwrapped and through DDP."""
    tiny = Subset(run.test_set, [0])
    t = evaluate_unpadded(run.raw_model, tiny, run.info)
    one = F.cross_entropy(logits[:1], run.test_set.tensors[1][:1]).item()
    run.report.claim(
        "tiny_eval_unwrapped_equals_one_process",
        abs(t["loss"] - one),
        "<=",
        1e-5,
        "  1 test image, shards {shards}: |loss - 1 process| {value:.1e} unwrapped",
        shards=all_gather_objects(t["shard"], run.info),
    )
    if run.info.world_size > 1:
        outcome = ddp_eval_with_empty_shard(tiny, run.info, run.args.hang_timeout_s)
        hang = all_gather_objects(outcome, run.info)
        run.report.claim(
            "ddp_eval_empty_shard_times_out",
            int(hang[0]["outcome"] == "timed out"),
            "==",
            1,
            "  the same through the DDP wrapper: rank 0 timed out in the buffer broadcast: {value}",
        )


def uneven_shards(run: Run) -> None:
    """2. Uneven shards: Join, then (2+ ranks) the plain loop and a user all-reduce inside Join."""
    k, b = run.args.join_batches, run.args.batch_size
    print0(f"\n2. Uneven shards: rank r holds {k} + r batches of {b}")
    loader = uneven_loader(run)
    out = train_with_join(run.model, run.raw_model, loader, run.info)
    want = [k + r for r in range(run.info.world_size)]
    per_rank = all_gather_objects(out["steps"], run.info)
    steps = run.report.value("join_steps", per_rank, "  with Join: steps per rank {value}")
    run.report.claim(
        "join_every_rank_finishes",
        int(steps == want),
        "==",
        1,
        "  ... = {want}: {value}",
        want=want,
    )
    run.report.claim(
        "join_replicas_identical",
        max_param_diff_across_ranks(run.raw_model, run.info),
        "==",
        0.0,
        "  max parameter difference across ranks {value:.1e}",
    )
    run.report.claim(
        "loss_reduced_after_loop",
        out["count"],
        "==",
        sum(want) * b,
        "  mean training loss {loss:.4f} reduced after the loop over {value} samples",
        loss=out["loss"],
    )
    if run.info.world_size > 1:
        without_join(run, loader)


def without_join(run: Run, loader: DataLoader) -> None:
    """2, continued (2+ ranks): the same loop without Join, and a user all-reduce inside Join."""
    timeout_s = run.args.hang_timeout_s
    plain = all_gather_objects(train_without_join(loader, run.info, timeout_s), run.info)
    outcomes = run.report.record("no_join", [h["outcome"] for h in plain])
    # rank 0 (fewest batches) leaves; every rank r > 0 waits in its extra step (W = 2: rank 1, the last)
    last_waits = int(outcomes == ["finished"] + ["timed out"] * (run.info.world_size - 1))
    run.report.claim(
        "no_join_last_rank_times_out",
        last_waits,
        "==",
        1,
        "  without Join: {outcomes} after {steps} full steps: {value}",
        outcomes=outcomes,
        steps=[h["steps"] for h in plain],
    )
    run.report.claim(
        "no_join_wait_bounded",
        max(h["seconds"] for h in plain),
        "<=",
        60,
        "without Join, seconds until every rank left the loop: {value:.2f}",
        perf=True,
    )
    with rank0_only(run.info, "the child world of the all_reduce-inside-Join demo") as mine:
        if mine:
            errors = all_reduce_inside_join_child(run.args.seed, timeout_s)
            run.report.claim(
                "user_all_reduce_inside_join_fails",
                int(bool(errors)),
                "==",
                1,
                "  dist.all_reduce(loss) inside Join: the child world failed in gloo: {value}",
            )
            run.report.perf("child_world_error", errors, "the child world's gloo error: {value}")


def timeouts(report: Report) -> None:
    """2, end: the default timeouts, and what NCCL does when a collective times out."""
    report.claim(
        "default_timeout_gloo_minutes",
        dist.constants.default_pg_timeout.total_seconds() / 60,
        "==",
        30,
        "  the default process-group timeout (gloo; NCCL's is 10 min): {value:g} min",
    )
    # 0: nothing, 2: abort the communicators without tearing down (ProcessGroupNCCL.hpp)
    mode = int(os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"))
    report.claim(
        "nccl_timeout_aborts",
        int(mode in (1, 3)),
        "==",
        1,
        "  TORCH_NCCL_ASYNC_ERROR_HANDLING = {mode} (unset: 3): 1 and 3 tear the process down"
        " on a timeout: {value}",
        mode=mode,
    )


def seeding(run: Run) -> None:
    """3. Seeding augmentations. The code to copy, after the model is built from one seed on every rank:
    `generator = seed_data_rngs(seed, rank)`, then `DataLoader(..., generator=generator)`."""
    W, n, k = run.info.world_size, run.args.aug_samples, run.args.workers
    print0(f"\n3. Seeding: {W} rank(s), {n} samples per rank, 0 and {k} DataLoader workers")
    demo = seeding_demo(
        run.args.seed, run.info.rank, n, k, lambda obj: all_gather_objects(obj, run.info)
    )
    for workers, (first, rerun) in demo["rank_seed"].items():
        run.report.claim(
            f"seed_data_rngs_distinct_{workers}_workers",
            min(distinct_streams(first)),
            "==",
            W * max(workers, 1),
            "  seed_data_rngs, {workers} workers: distinct torch/numpy/random streams {distinct}",
            workers=workers,
            distinct=distinct_streams(first),
        )
        run.report.claim(
            f"seed_data_rngs_rerun_identical_{workers}_workers",
            int(first == rerun),
            "==",
            1,
            "  ... and a rerun reproduces every stream: {value}",
        )
    fixed = {workers: runs[0] for workers, runs in demo["rank_seed"].items()}
    run.report.record(
        "seeding", {"same_seed": demo["same_seed"], "rank_seed": fixed[k], "zero_workers": fixed[0]}
    )
    seeding_mistakes(demo, W, k, run.report)


def seeding_mistakes(demo: dict, world_size: int, k: int, report: Report) -> None:
    """3, continued: one seed on every rank; loader_generator alone with 0 workers; epochs' base seeds."""
    pairs, same = world_size * (world_size - 1) // 2, demo["same_seed"]
    report.claim(
        "same_seed_duplicates_across_ranks",
        len(same["identical_pairs"]),
        "==",
        k * pairs,
        "  same seed, {k} workers: identical (rank, worker) streams {pairs}: {value} pair(s)",
        k=k,
        pairs=", ".join(same["identical_pairs"]) or "none",
    )
    report.claim(
        "workers_of_a_rank_differ",
        min(distinct_streams(same)),
        "==",
        k,
        "  ... though PyTorch seeds each worker: distinct torch/numpy/random streams {distinct}",
        distinct=distinct_streams(same),
    )
    # loader_generator(seed, rank) alone with 0 workers: it never reaches the main process
    report.claim(
        "zero_workers_generator_only_duplicates",
        len(demo["generator_only"]["identical_pairs"]),
        "==",
        pairs,
        "  0 workers, loader_generator only: identical {pairs}",
        pairs=describe_pairs(demo["generator_only"]),
    )
    for persistent, draws in demo["base_seeds"].items():
        report.claim(
            "generator_draws_two_epochs" + "_persistent" * persistent,
            draws,
            "==",
            2 - persistent,
            "  2 epochs, persistent_workers={persistent}: base seeds {value}",
            persistent=persistent,
        )


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        train_set, test_set = digits_split(path=args.data)  # (1438, 1, 8, 8), (359, 1, 8, 8)
        set_seed(args.seed)
        # norm="none": each step's only collective is the gradient all-reduce (BatchNorm across ranks: 06)
        raw_model = DigitsCNN(norm="none").to(info.device)  # identical on every rank: the same seed
        model = DDP(raw_model) if info.distributed else raw_model
        run = Run(args, info, Report(info), train_set, test_set, raw_model, model)
        if args.child:  # the child world launched in section 2: the failure, nothing else
            return all_reduce_inside_join(model, raw_model, uneven_loader(run), info)
        run.report.value(
            "world_size",
            info.world_size,
            "world_size {value}  backend {backend}  seed {seed}",
            backend=info.backend or "none",
            seed=args.seed,
        )
        evaluation(run)
        uneven_shards(run)
        timeouts(run.report)
        seeding(run)
        run.report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
