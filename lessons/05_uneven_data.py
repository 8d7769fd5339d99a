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

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from common.data import digits_split
from common.data_parallel.samplers import UnpaddedDistributedSampler
from common.data_parallel.seeding import describe_pairs, distinct_streams, seeding_demo
from common.exhibits.uneven import (
    all_reduce_inside_join_child,
    ddp_eval_with_empty_shard,
    train_without_join,
)
from common.harness.env import LessonError
from common.harness.metrics import evaluate
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


# 1. Evaluation without padding ------------------------------------------------------------------------------
@torch.no_grad()
def shard_sums(model, dataset, sampler, device) -> list[float]:
    """(loss_sum, correct, count) of `model` over the samples `sampler` gives this rank."""
    sums = [0.0, 0.0, 0.0]
    for x, y in DataLoader(dataset, batch_size=128, sampler=sampler):
        logits, y = model(x.to(device)), y.to(device)  # logits (B, 10)
        sums[0] += F.cross_entropy(logits, y, reduction="sum").item()
        sums[1] += (logits.argmax(1) == y).sum().item()
        sums[2] += len(y)
    return sums


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


def all_reduce_inside_join(model, raw_model, loader, info) -> None:
    """The mistake (run in a child world): train_with_join with a user all-reduce inside the loop. Rank 0 runs
    out first; its Join shadows DDP's collectives, which do not line up with rank 1's 1-element all-reduce."""
    optimizer = torch.optim.SGD(raw_model.parameters(), lr=0.05)
    with Join([model]) if info.distributed else nullcontext():
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(info.device)), y.to(info.device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            dist.all_reduce(loss.detach())  # breaks: a collective Join knows nothing about


def uneven_loader(train_set, info, args) -> DataLoader:
    """Rank r's join_batches + r batches, as when each rank reads its own shard file and the files differ."""
    sampler = DistributedSampler(train_set, info.world_size, info.rank, seed=args.seed)  # shuffled
    mine = list(sampler)[: (args.join_batches + info.rank) * args.batch_size]
    return DataLoader(Subset(train_set, mine), args.batch_size)


def evaluation(raw_model, test_set, info, args, report: Report) -> None:
    """1. Evaluation of the (untrained, accuracy about 0.1) model: the exact ways must agree."""
    print0(f"\n1. Evaluation on {len(test_set)} test images")
    ev = evaluate_unpadded(raw_model, test_set, info)
    report.claim(
        "unpadded_counts_every_image_once",
        ev["count"],
        "==",
        len(test_set),
        "  UnpaddedDistributedSampler shards {shards}, (sum, count) reduced: {value} images",
        shards=report.record("eval_shards", all_gather_objects(ev["shard"], info)),
    )
    xs, ys = test_set.tensors  # one process, the whole test set: the reference
    with torch.no_grad():
        logits = raw_model(xs.to(info.device)).cpu()  # (359, 10)
    single = {
        "loss": F.cross_entropy(logits, ys).item(),
        "accuracy": (logits.argmax(1) == ys).double().mean(),
    }
    # evaluated BEFORE training: loss about ln 10 = 2.303 and accuracy about 0.1 are chance on 10 digits
    report.value(
        "eval_unpadded",
        {k: ev[k] for k in ("loss", "accuracy", "count")},
        "  the untrained model (no step yet, 10 classes): loss {value[loss]:.6f} (ln 10 = 2.3026)"
        "  accuracy {value[accuracy]:.6f} (chance: 0.1)",
    )
    for name, other in (
        ("one_process", single),
        ("metrics_evaluate", evaluate(raw_model, test_set, info)),
    ):
        for key, bound in (("loss", 1e-5), ("accuracy", 1e-12)):
            report.claim(
                f"unpadded_equals_{name}_{key}",
                abs(ev[key] - other[key]),
                "<=",
                bound,
                "  |{key} - {ref} {key}| = {value:.1e}",
                key=key,
                ref=name,
            )
    report.claim(
        "padding_counted_as_data",
        padding_counted_as_data(raw_model, test_set, info),
        "==",
        info.world_size * -(-len(test_set) // info.world_size),
        "  DistributedSampler's padding counted as data: {value} images",
    )
    one_image(raw_model, test_set, logits, info, args, report)


def one_image(raw_model, test_set, logits, info, args, report: Report) -> None:
    """1, continued: 1 test image (with 2 ranks, rank 1's shard is empty), unwrapped and through DDP."""
    tiny = Subset(test_set, [0])
    t = evaluate_unpadded(raw_model, tiny, info)
    one = F.cross_entropy(logits[:1], test_set.tensors[1][:1]).item()
    report.claim(
        "tiny_eval_unwrapped_equals_one_process",
        abs(t["loss"] - one),
        "<=",
        1e-5,
        "  1 test image, shards {shards}: |loss - 1 process| {value:.1e} unwrapped",
        shards=all_gather_objects(t["shard"], info),
    )
    if info.world_size > 1:
        hang = all_gather_objects(ddp_eval_with_empty_shard(tiny, info, args.hang_timeout_s), info)
        report.claim(
            "ddp_eval_empty_shard_times_out",
            int(hang[0]["outcome"] == "timed out"),
            "==",
            1,
            "  the same through the DDP wrapper: rank 0 timed out in the buffer broadcast: {value}",
        )


def uneven_shards(model, raw_model, train_set, info, args, report: Report) -> None:
    """2. Uneven shards: Join, then (2+ ranks) the plain loop and a user all-reduce inside Join."""
    print0(f"\n2. Uneven shards: rank r holds {args.join_batches} + r batches of {args.batch_size}")
    loader = uneven_loader(train_set, info, args)
    out = train_with_join(model, raw_model, loader, info)
    want = [args.join_batches + r for r in range(info.world_size)]
    steps = report.value(
        "join_steps", all_gather_objects(out["steps"], info), "  with Join: steps per rank {value}"
    )
    report.claim(
        "join_every_rank_finishes",
        int(steps == want),
        "==",
        1,
        "  ... = {want}: {value}",
        want=want,
    )
    report.claim(
        "join_replicas_identical",
        max_param_diff_across_ranks(raw_model, info),
        "==",
        0.0,
        "  max parameter difference across ranks {value:.1e}",
    )
    report.claim(
        "loss_reduced_after_loop",
        out["count"],
        "==",
        sum(want) * args.batch_size,
        "  mean training loss {loss:.4f} reduced after the loop over {value} samples",
        loss=out["loss"],
    )
    if info.world_size > 1:
        without_join(loader, info, args, report)


def without_join(loader, info, args, report: Report) -> None:
    """2, continued (2+ ranks): the same loop without Join, and a user all-reduce inside Join."""
    plain = all_gather_objects(train_without_join(loader, info, args.hang_timeout_s), info)
    outcomes = report.record("no_join", [h["outcome"] for h in plain])
    # rank 0 (fewest batches) leaves; every rank r > 0 waits in its extra step (W = 2: rank 1, the last)
    last_waits = int(outcomes == ["finished"] + ["timed out"] * (info.world_size - 1))
    report.claim(
        "no_join_last_rank_times_out",
        last_waits,
        "==",
        1,
        "  without Join: {outcomes} after {steps} full steps: {value}",
        outcomes=outcomes,
        steps=[h["steps"] for h in plain],
    )
    report.claim(
        "no_join_wait_bounded",
        max(h["seconds"] for h in plain),
        "<=",
        60,
        "without Join, seconds until every rank left the loop: {value:.2f}",
        perf=True,
    )
    with rank0_only(info, "the child world of the all_reduce-inside-Join demo") as mine:
        if mine:
            errors = all_reduce_inside_join_child(args.seed, args.hang_timeout_s)
            report.claim(
                "user_all_reduce_inside_join_fails",
                int(bool(errors)),
                "==",
                1,
                "  dist.all_reduce(loss) inside Join: the child world failed in gloo: {value}",
            )
            report.perf("child_world_error", errors, "the child world's gloo error: {value}")


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


def seeding(info, args, report: Report) -> None:
    """3. Seeding augmentations. The code to copy, after the model is built from one seed on every rank:
    `generator = seed_data_rngs(seed, rank)`, then `DataLoader(..., generator=generator)`."""
    world_size, n, k = info.world_size, args.aug_samples, args.workers
    print0(
        f"\n3. Seeding: {world_size} rank(s), {n} samples per rank, 0 and {k} DataLoader workers"
    )
    demo = seeding_demo(args.seed, info.rank, n, k, lambda obj: all_gather_objects(obj, info))
    for workers, (run, rerun) in demo["rank_seed"].items():
        report.claim(
            f"seed_data_rngs_distinct_{workers}_workers",
            min(distinct_streams(run)),
            "==",
            world_size * max(workers, 1),
            "  seed_data_rngs, {workers} workers: distinct torch/numpy/random streams {distinct}",
            workers=workers,
            distinct=distinct_streams(run),
        )
        report.claim(
            f"seed_data_rngs_rerun_identical_{workers}_workers",
            int(run == rerun),
            "==",
            1,
            "  ... and a rerun reproduces every stream: {value}",
        )
    fixed = {workers: runs[0] for workers, runs in demo["rank_seed"].items()}
    report.record(
        "seeding", {"same_seed": demo["same_seed"], "rank_seed": fixed[k], "zero_workers": fixed[0]}
    )
    seeding_mistakes(demo, world_size, k, report)


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
        if args.child:  # the child world launched in section 2: the failure, nothing else
            loader = uneven_loader(train_set, info, args)
            return all_reduce_inside_join(model, raw_model, loader, info)
        report = Report(info)
        report.value(
            "world_size",
            info.world_size,
            "world_size {value}  backend {backend}  seed {seed}",
            backend=info.backend or "none",
            seed=args.seed,
        )
        evaluation(raw_model, test_set, info, args, report)
        uneven_shards(model, raw_model, train_set, info, args, report)
        timeouts(report)
        seeding(info, args, report)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
