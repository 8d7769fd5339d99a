"""Lesson 04: custom distributed samplers -- DistributedSampler rebuilt, __len__, weighted, length-grouped.

Run it:

    python lessons/04_custom_sampler.py                                    # one process (world of 1)
    torchrun --standalone --nproc_per_node=2 lessons/04_custom_sampler.py  # 2 processes, gloo on CPU
    torchrun --standalone --nproc_per_node=2 lessons/04_custom_sampler.py --demo-size 9  # steps differ

The samplers live in common/data_parallel/ (samplers.py, bucketing.py; the blog sampler in sampler_len.py);
their speed over 10^6 samples is benchmarks/sampler_speed.py. Uneven data is lesson 05.

What to look for:
1. DistributedSampler index by index: every rank computes the SAME permutation from seed + epoch, pads it by
   repeating its start (or drops the tail with drop_last) and takes every world_size-th index from its rank.
   The re-implementation equals PyTorch's indices on every configuration tried (832 of 832).
2. Myth: "a custom sampler's __len__ returns the dataset's length". It must return what THIS rank yields: the
   blog-post sampler (11 samples, batch 2, 2 ranks) says len(DataLoader) = 6 and yields 3 batches, so
   schedules and progress bars are wrong. Without padding its ranks hold 6 and 5 samples; step counts differ
   only when ceil(n/W) and floor(n/W) samples make different numbers of batches: here [3, 3] steps without
   drop_last, [3, 2] with it (9 samples: [3, 2] without). Under DDP the rank with more steps then waits in an
   all-reduce the other never joins, until the process-group timeout (lesson 05).
3. Weighted sampling on imbalanced digits: class histograms per rank 20:1 before, roughly flat after (claimed
   over all ranks' draws: a rank's ~m/W draws are noisier); rank streams differ. With replacement the ranks'
   union is WeightedRandomSampler's draw; without, that draw plus padding.
4. Length-grouped batches: the padded-token fraction falls from 0.75 to 0.07 (cut by 90%), with the same
   number of batches on every rank.

Sources: https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler and its
source torch/utils/data/distributed.py;
https://pytorch.org/docs/stable/data.html#torch.utils.data.WeightedRandomSampler.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DistributedSampler

from common.data import NUM_CLASSES, class_hist, digits_split, imbalanced_subset
from common.data_parallel.bucketing import (
    LengthGroupedDistributedBatchSampler,
    padded_tokens,
    synthetic_lengths,
)
from common.data_parallel.sampler_len import (
    BlogShardSampler,
    blog_steps_differ,
    len_vs_yield,
    step_rule_mismatches,
)
from common.data_parallel.samplers import (
    DistributedSamplerByHand,
    count_matching_configs,
    distributed_indices,
)
from common.data_parallel.weighted_sampler import (
    WeightedDistributedSampler,
    weighted_union_vs_torch,
)
from common.harness.env import DistInfo, LessonError
from common.harness.ranks import all_gather_objects, print0
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0, help="sampler seed (>= 0)")
    p.add_argument("--demo-size", type=int, default=11, help="dataset size in sections 1-2")
    p.add_argument("--batch-size", type=int, default=2, help="batch size per process in section 2")
    p.add_argument(
        "--imbalance", type=float, default=0.05, help="class c keeps imbalance**(c/9) of its images"
    )
    p.add_argument("--seq-count", type=int, default=20000, help="synthetic sequences for bucketing")
    p.add_argument("--seq-batch", type=int, default=32, help="sequences per batch per process")
    p.add_argument("--pool-batches", type=int, default=50, help="batches per length-sorting pool")
    p.add_argument("--data", default=None, help="digits .npz (default: data/digits.npz)")
    p.add_argument("--results", default=None, help="rank 0 writes the reported numbers here (JSON)")
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validate before any process group exists: every rank sees the same argv, so every rank fails alike.
    positive = ("demo_size", "batch_size", "seq_count", "pool_batches")
    lows = {**dict.fromkeys(positive, 1), "seq_batch": 2, "seed": 0}  # the least each accepts
    kinds = {0: ">= 0", 1: "a positive integer", 2: ">= 2 (1 sequence per batch has no padding)"}
    for name, low in lows.items():
        if getattr(args, name) < low:
            flag = "--" + name.replace("_", "-")
            raise LessonError(f"{flag} must be {kinds[low]}, got {getattr(args, name)}")
    if not 0.0 < args.imbalance <= 1.0:
        raise LessonError(f"--imbalance must be in (0, 1], got {args.imbalance}")
    return args


@dataclass
class Run:
    """What the sections share: the options, this rank, the report."""

    args: argparse.Namespace
    info: DistInfo
    report: Report


def which_indices(run: Run) -> None:
    """1. Which indices this rank reads in epochs 0 and 1, from PyTorch's sampler and from ours."""
    W, rank, n, seed = run.info.world_size, run.info.rank, run.args.demo_size, run.args.seed
    print0(
        f"\n1. DistributedSampler, {n} samples over {W} rank(s): seed + epoch permutation, pad, stride"
    )
    mine = []
    for epoch in (0, 1):
        ref = DistributedSampler(range(n), W, rank, shuffle=True, seed=seed)
        ref.set_epoch(epoch)  # permutation seed = seed + epoch, the same on every rank
        mine.append((list(ref), distributed_indices(n, W, rank, True, seed, epoch).tolist()))
    per_rank = all_gather_objects(mine, run.info)
    # indices[epoch][rank], torch's (ours are claimed equal below)
    indices = run.report.record("indices", [[f[e][0] for f in per_rank] for e in (0, 1)])
    print0("\n".join(f"  epoch {e} rank {r}: {indices[e][r]}" for e in (0, 1) for r in range(W)))
    run.report.claim(
        "padding_repeats",
        sum(map(len, indices[0])) - n,
        "==",
        (-n) % W,
        "  padding: the ranks read {value} index(es) twice, (-n) mod W = {bound}",
    )
    # 1 index has one order; 2..4 (2 or 6 or 24 orders) repeat by chance (1 in 2 seeds for n = 2)
    if n >= 5:
        run.report.claim(
            "set_epoch_changes_permutation",
            int(indices[0] != indices[1]),
            "==",
            1,
            "  set_epoch(1) changes the permutation: {value}",
        )
    same = int(all(a == b for f in per_rank for a, b in f))
    run.report.claim(
        "by_hand_equals_torch_this_run",
        same,
        "==",
        1,
        "  by-hand sampler == torch DistributedSampler on every rank of this run: {value}",
    )
    match, total = count_matching_configs(seeds=(seed, seed + 7))
    run.report.record("configs_total", total)
    run.report.claim(
        "by_hand_equals_torch_configs",
        total - match,
        "==",
        0,
        "  ... on {match} of {total} configs (n 0..12, W 1..4, shuffle, drop_last, 2 seeds, 2 epochs): "
        "{value} differ",
        match=match,
        total=total,
    )


def len_per_rank(run: Run) -> None:
    """2. __len__ (myth 5): DataLoader len vs batches yielded on THIS rank, ours and the blog sampler."""
    W, rank, n, b = run.info.world_size, run.info.rank, run.args.demo_size, run.args.batch_size
    seed = run.args.seed
    print0(
        f"\n2. __len__ per rank: DataLoader(batch_size={b}) over {n} samples, len / batches yielded"
    )
    grouped = LengthGroupedDistributedBatchSampler(synthetic_lengths(n, seed), b, W, rank, seed)
    mine = {
        "by_hand": len_vs_yield(DistributedSamplerByHand(n, W, rank, seed=seed), b, False),
        "by_hand_drop_last": len_vs_yield(DistributedSamplerByHand(n, W, rank, seed=seed), b, True),
        "length_grouped": {"len": len(grouped), "yielded": sum(1 for _ in grouped)},
        "blog": len_vs_yield(BlogShardSampler(n, W, rank), b, False),
        "blog_drop_last": len_vs_yield(BlogShardSampler(n, W, rank), b, True),
    }
    per_rank = all_gather_objects(mine, run.info)
    rows = {k: [m[k] for m in per_rank] for k in mine}  # name -> [rank 0's, rank 1's, ...]
    for name, cells in rows.items():
        counts = "  ".join(f"r{r}: {c['len']:>2}/{c['yielded']:>2}" for r, c in enumerate(cells))
        print0(f"  {name:<18} {counts}")
    run.report.record("len_check", rows)
    ours = [rows[k] for k in ("by_hand", "by_hand_drop_last", "length_grouped")]
    run.report.claim(
        "our_len_equals_yield",
        sum(c["len"] != c["yielded"] for cells in ours for c in cells),
        "==",
        0,
        "  our samplers: ranks where len(DataLoader) != batches yielded: {value}",
    )
    uneven = sum(len({c["yielded"] for c in cells}) > 1 for cells in ours)
    run.report.claim(
        "our_steps_equal_on_every_rank",
        uneven,
        "==",
        0,
        "  our samplers: samplers whose ranks run different step counts: {value}",
    )
    blog_sampler(run, rows)


def blog_sampler(run: Run, rows: dict) -> None:
    """2, continued: what the blog sampler says and yields, and the rule for when its ranks' steps differ."""
    W, n, b = run.info.world_size, run.args.demo_size, run.args.batch_size
    run.report.claim(
        "blog_len_is_dataset_batches",
        rows["blog"][0]["len"],
        "==",
        math.ceil(n / b),
        "  the blog sampler says len(DataLoader) = {value} = ceil(n / batch) (the dataset's)",
    )
    run.report.claim(
        "blog_yields_rank_share",
        rows["blog"][0]["yielded"],
        "==",
        math.ceil(math.ceil(n / W) / b),
        "  ... and yields {value} batches on rank 0 = ceil(ceil(n / W) / batch) (this rank's)",
    )
    for key, dl in (("blog", False), ("blog_drop_last", True)):
        steps = [c["yielded"] for c in rows[key]]
        run.report.claim(
            f"{key}_steps_differ_as_the_rule_says",
            int(len(set(steps)) > 1),
            "==",
            int(blog_steps_differ(n, W, b, dl)),
            "  blog sampler, drop_last={dl}: steps per rank {steps}; they differ: {value}",
            dl=dl,
            steps=steps,
        )
    bad, total = step_rule_mismatches()
    run.report.claim(
        "blog_step_rule_exact",
        bad,
        "==",
        0,
        "  blog_steps_differ vs {total} configurations (n 1..40, W 1..4, batch 1..4, drop_last): "
        "{value} mismatches",
        total=total,
    )
    uneven = [k for k in range(1, 17) if blog_steps_differ(k, W, b, False)]
    run.report.value(
        "blog_sizes_with_uneven_steps",
        uneven,
        "  W={W}, batch {b}, no drop_last: the sizes 1..16 whose ranks' steps differ are {value}",
        W=W,
        b=b,
    )


def weighted_sampling(run: Run) -> None:
    """3. Class histograms per rank: plain DistributedSampler vs weights 1 / class count."""
    W, rank, seed = run.info.world_size, run.info.rank, run.args.seed
    train_set, _ = digits_split(path=run.args.data)  # 1438 images
    subset, labels = imbalanced_subset(train_set, run.args.imbalance, seed)
    class_count = torch.bincount(labels, minlength=NUM_CLASSES)
    print0(
        f"\n3. Weighted sampling, imbalanced digits subset of {len(labels)} images "
        f"(class counts {class_count.tolist()})"
    )
    run.report.claim(
        "class_imbalance",
        (class_count[0] / class_count[-1]).item(),
        ">=",
        10,
        "  most / least frequent class: {value:.1f}",
    )
    weights = 1.0 / class_count[labels].double()  # every class equally likely in expectation
    weighted = WeightedDistributedSampler(weights, W, rank, seed=seed)
    first = list(weighted)
    weighted.set_epoch(1)
    plain = list(DistributedSampler(subset, W, rank, shuffle=True, seed=seed))
    mine = {
        "plain": class_hist(labels, plain),
        "weighted": class_hist(labels, first),
        "indices": first,
        "deterministic": first == list(WeightedDistributedSampler(weights, W, rank, seed=seed)),
        "epoch_changes_order": list(weighted) != first,
        "no_replacement": list(
            WeightedDistributedSampler(weights, W, rank, 50 * W + 1, False, seed)
        ),
    }
    per_rank = all_gather_objects(mine, run.info)
    hists = {k: [f[k] for f in per_rank] for k in ("plain", "weighted")}
    ratio = {k: [max(h) / max(min(h), 1) for h in v] for k, v in hists.items()}
    for k in hists:
        for r, h in enumerate(hists[k]):
            print0(f"  {k:<8} rank {r}: {h}  max/min {ratio[k][r]:.2f}")
    run.report.record(
        "weighted", {"class_count": class_count.tolist(), "hist": hists, "max_min_ratio": ratio}
    )
    text = "  plain: smallest max/min {value:.2f}"
    run.report.claim("plain_stays_imbalanced", min(ratio["plain"]), ">=", 5, text)
    weighted_streams(run, hists, per_rank)
    weighted_unions(run, weights, per_rank)


def weighted_streams(run: Run, hists: dict, per_rank: list) -> None:
    """3, continued: the weighted draws rebalance the classes; each rank's stream is seeded, and its own."""
    W = run.info.world_size
    # all ranks' draws: ~m/W per rank is noisier (W = 4: ~5)
    union_hist = torch.tensor(hists["weighted"]).sum(0)
    run.report.claim(
        "weighted_rebalances",
        (union_hist.max() / union_hist.min().clamp_min(1)).item(),
        "<=",
        3,
        "  weighted, all {W} rank(s) together: max/min {value:.2f}",
        W=W,
    )
    run.report.claim(
        "weighted_deterministic",
        int(all(f["deterministic"] for f in per_rank)),
        "==",
        1,
        "  weighted: the same seed gives the same stream: {value}",
    )
    run.report.claim(
        "weighted_set_epoch_changes_order",
        int(all(f["epoch_changes_order"] for f in per_rank)),
        "==",
        1,
        "  weighted: set_epoch(1) changes the order: {value}",
    )
    if W > 1:
        run.report.claim(
            "weighted_ranks_differ",
            len({tuple(f["indices"]) for f in per_rank}),
            "==",
            W,
            "  weighted: distinct rank streams {value}",
        )


def weighted_unions(run: Run, weights: torch.Tensor, per_rank: list) -> None:
    """3, continued: the ranks' streams interleaved against WeightedRandomSampler's draw in one process."""
    # Without replacement, m = 50 W + 1 draws fill W * 51 positions: the last W - 1 repeat the start
    W = run.info.world_size
    m = 50 * W + 1
    with_r, without = [f["indices"] for f in per_rank], [f["no_replacement"] for f in per_rank]
    union = weighted_union_vs_torch(weights, with_r, without, m, run.args.seed)
    run.report.claim(
        "weighted_union_equals_torch_draw",
        int(union["with"]),
        "==",
        1,
        "  with replacement, ranks interleaved == WeightedRandomSampler's draw in one process: "
        "{value}",
    )
    run.report.claim(
        "weighted_no_replacement_is_torch_draw_plus_padding",
        int(union["padded"]),
        "==",
        1,
        "  without replacement, {m} draws: ranks interleaved == WeightedRandomSampler({m}) + "
        "padding: {value}",
        m=m,
    )
    run.report.claim(
        "weighted_no_replacement_equals_torch_total_draw_only_if_w_divides",
        int(union["whole"]),
        "==",
        int(m % W == 0),
        "  ... == its draw of all {positions} positions: {value} ({m} mod {W} = {rest})",
        positions=union["positions"],
        m=m,
        W=W,
        rest=m % W,
    )


def bucketing(run: Run) -> None:
    """4. Padded tokens of random batches (DistributedSampler, then consecutive seq_batch chunks, as
    DataLoader(batch_size=...) does) vs length-grouped batches, over this rank's epoch 0."""
    W, rank, seed = run.info.world_size, run.info.rank, run.args.seed
    count, B = run.args.seq_count, run.args.seq_batch
    print0(f"\n4. Bucketing: {count} sequences (log-normal lengths), {B} per batch per rank")
    lengths = synthetic_lengths(count, seed)
    rand_idx = list(DistributedSampler(range(count), W, rank, shuffle=True, seed=seed))
    rand_batches = [rand_idx[i : i + B] for i in range(0, len(rand_idx), B)]
    bucket = LengthGroupedDistributedBatchSampler(lengths, B, W, rank, seed, run.args.pool_batches)
    bucket_batches = list(bucket)
    tokens = [*padded_tokens(rand_batches, lengths), *padded_tokens(bucket_batches, lengths)]
    per_rank = all_gather_objects([*tokens, len(bucket_batches), len(bucket)], run.info)
    report_padding(run, per_rank)
    hist = np.histogram(lengths.numpy(), bins=32, range=(0, 512))[0]
    run.report.record("lengths_hist", hist.tolist())


def report_padding(run: Run, per_rank: list) -> None:
    """4, continued: rank r's [real, computed tokens of random batches, the same for length-grouped batches,
    batches yielded, len] -> the padded fractions over all ranks, and the claims."""
    # real and computed (padded) tokens, random then bucketed, summed over ranks
    real_r, pad_r, real_b, pad_b = (sum(f[i] for f in per_rank) for i in range(4))
    frac_r, frac_b = 1 - real_r / pad_r, 1 - real_b / pad_b
    run.report.record("padded_fraction_random", frac_r)
    run.report.value(
        "padded_fraction_bucketed",
        frac_b,
        "  padded-token fraction: random batches {random:.4f}, length-grouped {value:.4f}",
        random=frac_r,
    )
    run.report.claim(
        "bucketing_cuts_padding",
        1 - frac_b / frac_r,
        ">=",
        0.85,
        "  tokens computed {random} -> {bucketed}: padding cut by {value:.1%}",
        random=pad_r,
        bucketed=pad_b,
    )
    run.report.claim(
        "bucketing_below_half_of_random",
        frac_b / frac_r,
        "<=",
        0.5,
        "  length-grouped / random padded fraction: {value:.3f}",
    )
    run.report.claim(
        "bucketing_same_batches_every_rank",
        len({(f[4], f[5]) for f in per_rank}),
        "==",
        1,
        "  batches per rank {yielded}, len {lens}: distinct (yielded, len) pairs {value}",
        yielded=[f[4] for f in per_rank],
        lens=[f[5] for f in per_rank],
    )


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        report = Report(info)
        report.value(
            "world_size",
            info.world_size,
            "world_size {value}  backend {backend}  seed {seed}",
            backend=info.backend or "none",
            seed=args.seed,
        )
        run = Run(args, info, report)
        which_indices(run)
        len_per_rank(run)
        weighted_sampling(run)
        bucketing(run)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
