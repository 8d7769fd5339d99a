"""Lesson 05: uneven data -- evaluation without padding, Join for uneven shards, per-rank random streams.

Run it:

    python lessons/05_uneven_data.py                                    # one process (world of 1)
    torchrun --standalone --nproc_per_node=2 lessons/05_uneven_data.py  # 2 processes: the failures need 2

What to look for:
1. Evaluation: UnpaddedDistributedSampler gives ranks 180 and 179 of 359 test images; (loss_sum, correct,
   count) summed over ranks, divided once, equals one process and common.harness.metrics.evaluate (padding
   counted: 360). Evaluate the UNWRAPPED model: with 1 image on 2 ranks, rank 1's shard is empty, and through
   the DDP wrapper rank 0's forward broadcasts buffers (BatchNorm statistics) that rank 1 never joins, until
   the timeout (2 s here).
2. Join: rank r holds 4 + r batches. Under `Join([model])` every rank finishes, after 4 and 5 steps, with
   identical parameters: a rank that ran out shadows DDP's collectives. Without Join, rank 1 (every rank but
   0) waits in its 5th gradient all-reduce until the timeout. Join covers ONLY the collectives of the objects
   it wraps (DDP's all-reduce and buffer broadcast, ZeroRedundancyOptimizer): a `dist.all_reduce(loss)` of
   yours inside the loop meets the finished rank's shadow collectives and gloo fails ("Received data size
   doesn't match expected size"; the process aborts: shown in a child world). Reduce (loss_sum, count) after
   the loop, or agree on a step count first (all-reduce MIN of the batch counts) and need no Join. Timeouts:
   there is always one, by default 30 min for gloo, 10 min for NCCL; on NCCL a timed-out collective does not
   raise, the watchdog tears the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING: torchrun sets 1, the default
   is 3; both tear down, 2 only aborts the communicators). So the failure demos run on CPU with gloo, in
   groups of their own with a short timeout.
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
import time
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from common.data import digits_split
from common.data_parallel.samplers import UnpaddedDistributedSampler
from common.data_parallel.seeding import (
    augmentation_streams,
    describe_pairs,
    generator_draws,
    loader_generator,
    seed_data_rngs,
    stream_summary,
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
    barrier,
    distributed_session,
    rank0_only,
    run_main,
    set_seed,
)
from common.models import DigitsCNN
from common.run.launch import run_command, torchrun_command


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--seed", type=int, default=0, help="model init, data order, augmentation seed (>= 0)"
    )
    p.add_argument(
        "--join-batches", type=int, default=4, help="rank r trains on join-batches + r batches"
    )
    p.add_argument(
        "--batch-size", type=int, default=16, help="samples per batch per process in the Join demo"
    )
    p.add_argument(
        "--hang-timeout-s", type=float, default=2.0, help="timeout of the failure demos' groups (s)"
    )
    p.add_argument(
        "--workers", type=int, default=2, help="DataLoader workers per rank in the seeding demo"
    )
    p.add_argument(
        "--aug-samples", type=int, default=8, help="samples per rank in the seeding demo"
    )
    p.add_argument(
        "--data", default=None, help="digits .npz (default: the bundled data/digits.npz)"
    )
    p.add_argument(
        "--results", default=None, help="rank 0 writes the reported numbers here as JSON"
    )
    # section 2's child world
    p.add_argument("--child", choices=["all-reduce-in-join"], help=argparse.SUPPRESS)
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validate before any process group exists: every rank sees the same argv, so every rank fails alike.
    for name, low in (
        ("join_batches", 1),
        ("batch_size", 1),
        ("workers", 1),
        ("aug_samples", 1),
        ("seed", 0),
    ):
        if getattr(args, name) < low:
            what = "a positive integer" if low else ">= 0"
            raise LessonError(
                f"--{name.replace('_', '-')} must be {what}, got {getattr(args, name)}"
            )
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


def run_until_timeout(steps) -> dict:
    """Run the iterator `steps` to its end.

    Returns {"outcome": "finished" | "timed out" | the error, "steps", "seconds"}."""
    t0, outcome, done = time.perf_counter(), "finished", 0
    try:
        for _ in steps:
            done += 1
    except (
        RuntimeError
    ) as e:  # gloo: "Timed out waiting 2000ms for recv ..." or "Application timeout ..."
        outcome = (
            "timed out"
            if "time" in str(e).lower()
            else f"error: {type(e).__name__}: {str(e)[:200]}"
        )
    return {"outcome": outcome, "steps": done, "seconds": time.perf_counter() - t0}


# 1. Evaluation without padding ------------------------------------------------------------------------------
@torch.no_grad()
def shard_sums(model, dataset, sampler, device) -> list[float]:
    """(loss_sum, correct, count) of `model` over the samples `sampler` gives this rank."""
    sums = [0.0, 0.0, 0.0]
    for x, y in DataLoader(dataset, batch_size=128, sampler=sampler):
        logits, y = model(x.to(device)), y.to(device)  # logits (B, 10)
        sums = [
            sums[0] + F.cross_entropy(logits, y, reduction="sum").item(),
            sums[1] + (logits.argmax(1) == y).sum().item(),
            sums[2] + len(y),
        ]
    return sums


def evaluate_unpadded(raw_model, dataset, info) -> dict:
    """The code to copy: each rank its unpadded shard, the UNWRAPPED model, (sum, count) reduced,
    divided once."""
    sampler = UnpaddedDistributedSampler(dataset, info.world_size, info.rank)
    mine = shard_sums(raw_model, dataset, sampler, info.device)
    loss_sum, correct, count = all_reduce_sum(
        mine, info
    )  # an empty shard still joins this all-reduce
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


def ddp_eval_with_empty_shard(dataset, info, timeout_s: float) -> dict:
    """The mistake: evaluating through the DDP wrapper when a rank's shard is empty (len(dataset) < W).

    DDP's first forward (and the first after any training step) broadcasts rank 0's buffers; a rank with no
    batch never calls forward. On CPU in a gloo group of its own, so the wait ends after `timeout_s`."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    model = DDP(
        DigitsCNN(), process_group=group
    ).eval()  # BatchNorm: running statistics are buffers
    sampler = UnpaddedDistributedSampler(dataset, info.world_size, info.rank)
    with torch.no_grad():
        out = run_until_timeout(model(x) for x, _ in DataLoader(dataset, sampler=sampler))
    barrier(info)  # the default group (timeout --timeout-s): everyone continues together
    return out


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
    loss_sum, count = all_reduce_sum(
        [loss_sum, count], info
    )  # after the loop, where every rank takes part
    return {"steps": steps, "loss": loss_sum / count, "count": int(count)}


def train_without_join(loader, info, timeout_s: float) -> dict:
    """The mistake: the same loop without Join (CPU, gloo group with `timeout_s`): the rank with more batches
    waits in its extra step's all-reduce for a partner that never comes."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    model = DDP(DigitsCNN(norm="none"), process_group=group)
    out = run_until_timeout(
        F.cross_entropy(model(x), y).backward() for x, y in loader
    )  # one step per item
    barrier(info)  # the default group (timeout --timeout-s): everyone continues together
    return out


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
            dist.all_reduce(
                loss.detach()
            )  # the line that breaks: a collective Join knows nothing about


def uneven_loader(train_set, info, args) -> DataLoader:
    """Rank r's join_batches + r batches, as when each rank reads its own shard file and the files differ."""
    shard = list(
        DistributedSampler(train_set, info.world_size, info.rank, shuffle=True, seed=args.seed)
    )
    mine = shard[: (args.join_batches + info.rank) * args.batch_size]
    return DataLoader(Subset(train_set, mine), args.batch_size)


def evaluation(raw_model, test_set, info, args, report: Report) -> None:
    """1. Evaluation of the (untrained, accuracy about 0.1) model: the exact ways must agree."""
    W = info.world_size
    print0(f"\n1. Evaluation on {len(test_set)} test images")
    ev = evaluate_unpadded(raw_model, test_set, info)
    shards = report.record("eval_shards", all_gather_objects(ev["shard"], info))
    report.claim(
        "unpadded_counts_every_image_once",
        ev["count"],
        "==",
        len(test_set),
        f"  UnpaddedDistributedSampler shards {shards}, (sum, count) reduced: {{value}} images",
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
        report.claim(
            f"unpadded_equals_{name}_loss",
            abs(ev["loss"] - other["loss"]),
            "<=",
            1e-5,
            f"  |loss - {name} loss| = {{value:.1e}}",
        )
        report.claim(
            f"unpadded_equals_{name}_accuracy",
            abs(ev["accuracy"] - other["accuracy"]),
            "<=",
            1e-12,
            f"  |accuracy - {name} accuracy| = {{value:.1e}}",
        )
    report.claim(
        "padding_counted_as_data",
        padding_counted_as_data(raw_model, test_set, info),
        "==",
        W * -(-len(test_set) // W),
        "  DistributedSampler's padding counted as data: {value} images",
    )
    tiny = Subset(test_set, [0])  # 1 image: with 2 ranks, rank 1's shard is empty
    t, one = evaluate_unpadded(raw_model, tiny, info), F.cross_entropy(logits[:1], ys[:1]).item()
    report.claim(
        "tiny_eval_unwrapped_equals_one_process",
        abs(t["loss"] - one),
        "<=",
        1e-5,
        f"  1 test image, shards {all_gather_objects(t['shard'], info)}: |loss - 1 process| "
        "{value:.1e} unwrapped",
    )
    if W > 1:
        hang = all_gather_objects(ddp_eval_with_empty_shard(tiny, info, args.hang_timeout_s), info)
        report.claim(
            "ddp_eval_empty_shard_times_out",
            int(hang[0]["outcome"] == "timed out"),
            "==",
            1,
            "  the same through the DDP wrapper: rank 0 timed out in the buffer broadcast: {value}",
        )


def uneven_shards(model, raw_model, train_set, info, args, report: Report) -> None:
    """2. Uneven shards: Join, the plain loop, and a user all-reduce inside Join (in a child world)."""
    W = info.world_size
    print0(f"\n2. Uneven shards: rank r holds {args.join_batches} + r batches of {args.batch_size}")
    loader = uneven_loader(train_set, info, args)
    out = train_with_join(model, raw_model, loader, info)
    want = [args.join_batches + r for r in range(W)]
    steps = report.value(
        "join_steps", all_gather_objects(out["steps"], info), "  with Join: steps per rank {value}"
    )
    report.claim(
        "join_every_rank_finishes", int(steps == want), "==", 1, f"  ... = {want}: {{value}}"
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
        f"  mean training loss {out['loss']:.4f} reduced after the loop over {{value}} samples",
    )
    if W > 1:
        plain = all_gather_objects(train_without_join(loader, info, args.hang_timeout_s), info)
        outcomes = report.record("no_join", [h["outcome"] for h in plain])
        # rank 0 (fewest batches) leaves; every rank r > 0 waits in its extra step (W = 2: rank 1, the last)
        last_waits = int(outcomes == ["finished"] + ["timed out"] * (W - 1))
        report.claim(
            "no_join_last_rank_times_out",
            last_waits,
            "==",
            1,
            f"  without Join: {outcomes} after {[h['steps'] for h in plain]} full steps: {{value}}",
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
            if (
                mine
            ):  # its own torchrun, 2 processes: the failing one aborts, which would end this world
                all_reduce_inside_join_child(args, report)


def all_reduce_inside_join_child(args, report: Report) -> None:
    """2, continued (rank 0): a child world of 2 processes runs `all_reduce_inside_join` and fails in gloo."""
    child = run_command(
        torchrun_command(
            "05_uneven_data",
            2,
            [
                "--child",
                "all-reduce-in-join",
                "--device",
                "cpu",
                "--backend",
                "gloo",
                "--timeout-s",
                str(args.hang_timeout_s),
                "--hang-timeout-s",
                str(args.hang_timeout_s / 2),
                "--seed",
                str(args.seed),
            ],
        ),
        timeout_s=180,
    )
    why = [w for w in ("doesn't match expected size", "timed out") if w in child.stderr.lower()]
    report.claim(
        "user_all_reduce_inside_join_fails",
        int(child.returncode != 0 and bool(why)),
        "==",
        1,
        "  dist.all_reduce(loss) inside Join: the child world failed in gloo: {value}",
    )
    report.perf("child_world_error", why, "the child world's gloo error: {value}")


def timeouts(report: Report) -> None:
    """2, end: the default timeouts, and what NCCL does when a collective times out."""
    minutes = dist.constants.default_pg_timeout.total_seconds() / 60
    report.claim(
        "default_timeout_gloo_minutes",
        minutes,
        "==",
        30,
        "  the default process-group timeout (gloo; NCCL's is 10 min): {value:g} min",
    )
    mode = int(
        os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    )  # 0 nothing, 2 no tear-down (.hpp)
    report.claim(
        "nccl_timeout_aborts",
        int(mode in (1, 3)),
        "==",
        1,
        f"  TORCH_NCCL_ASYNC_ERROR_HANDLING = "
        f"{mode} (unset: 3): 1 and 3 tear the process down when an NCCL collective times out: "
        "{value}",
    )


def distinct_streams(summary: dict) -> list[int]:
    """Distinct torch, numpy and random streams of a `stream_summary`."""
    return list(summary["distinct_per_library"].values())


def seeding(info, args, report: Report) -> None:
    """3. Seeding augmentations. The code to copy: seed_data_rngs(seed, rank) after the model is built."""
    W, rank, seed, n, k = info.world_size, info.rank, args.seed, args.aug_samples, args.workers
    print0(f"\n3. Seeding: {W} rank(s), {n} samples per rank, 0 and {k} DataLoader workers")
    fixed = {}
    for w in (0, k):
        runs = []
        for _ in range(2):  # a run and its rerun
            set_seed(
                seed
            )  # as in lesson 03: the model is built from this seed, the same on every rank
            streams = augmentation_streams(n, w, seed_data_rngs(seed, rank))
            runs.append(stream_summary(all_gather_objects(streams, info)))
        fixed[w] = runs[0]
        report.claim(
            f"seed_data_rngs_distinct_{w}_workers",
            min(distinct_streams(runs[0])),
            "==",
            W * max(w, 1),
            f"  seed_data_rngs, {w} workers: distinct torch/numpy/random streams "
            f"{distinct_streams(runs[0])}",
        )
        report.claim(
            f"seed_data_rngs_rerun_identical_{w}_workers",
            int(runs[0] == runs[1]),
            "==",
            1,
            "  ... and a rerun reproduces every stream: {value}",
        )
    set_seed(seed)  # the mistakes: the same seed on every rank and no generator (k workers) ...
    same = stream_summary(all_gather_objects(augmentation_streams(n, k, None), info))
    report.claim(
        "same_seed_duplicates_across_ranks",
        len(same["identical_pairs"]),
        "==",
        k * W * (W - 1) // 2,
        f"  same seed, {k} workers: identical streams {describe_pairs(same)}: {{value}} pair(s)",
    )
    report.claim(
        "workers_of_a_rank_differ",
        min(distinct_streams(same)),
        "==",
        k,
        f"  ... though PyTorch "
        f"seeds each worker: distinct torch/numpy/random streams {distinct_streams(same)}",
    )
    # ... and loader_generator(seed, rank) alone with 0 workers: it never reaches the main process
    set_seed(seed)
    streams = augmentation_streams(n, 0, loader_generator(seed, rank))
    gen_only = stream_summary(all_gather_objects(streams, info))
    report.claim(
        "zero_workers_generator_only_duplicates",
        len(gen_only["identical_pairs"]),
        "==",
        W * (W - 1) // 2,
        f"  0 workers, loader_generator only: identical {describe_pairs(gen_only)}",
    )
    report.record("seeding", {"same_seed": same, "rank_seed": fixed[k], "zero_workers": fixed[0]})
    for persistent in (False, True):
        g = loader_generator(seed, rank)
        augmentation_streams(n, k, g, epochs=2, persistent=persistent)
        report.claim(
            "generator_draws_two_epochs" + "_persistent" * persistent,
            generator_draws(g, seed, rank),
            "==",
            2 - persistent,
            f"  2 epochs, persistent_workers={persistent}: base seeds {{value}}",
        )


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        train_set, test_set = digits_split(
            path=args.data
        )  # (1438, 1, 8, 8) and (359, 1, 8, 8) on every rank
        set_seed(args.seed)
        # norm="none": each step's only collective is the gradient all-reduce (BatchNorm across ranks: 06)
        raw_model = DigitsCNN(norm="none").to(info.device)  # identical on every rank: the same seed
        model = DDP(raw_model) if info.distributed else raw_model
        if args.child:  # the child world launched in section 2: the failure, nothing else
            return all_reduce_inside_join(
                model, raw_model, uneven_loader(train_set, info, args), info
            )
        report = Report(info)
        report.value(
            "world_size",
            info.world_size,
            f"world_size {{value}}  backend {info.backend or 'none'}  seed {args.seed}",
        )
        evaluation(raw_model, test_set, info, args, report)
        uneven_shards(model, raw_model, train_set, info, args, report)
        timeouts(report)
        seeding(info, args, report)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
