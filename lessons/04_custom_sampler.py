"""Lesson 04: custom distributed samplers -- DistributedSampler rebuilt, __len__, weighted, length-grouped.

Run it:

    python lessons/04_custom_sampler.py                                    # one process (world of 1)
    torchrun --standalone --nproc_per_node=2 lessons/04_custom_sampler.py  # 2 processes, gloo on CPU
    torchrun --standalone --nproc_per_node=2 lessons/04_custom_sampler.py --demo-size 9  # steps differ

The samplers live in common/data_parallel/samplers.py and common/data_parallel/bucketing.py, where later
lessons import them; their speed over 10^6 samples is benchmarks/sampler_speed.py. Uneven data (unpadded
evaluation, Join, per-rank seeding) is lesson 05. Every number is printed once, with the bound it is held to,
and recorded in --results.

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
from itertools import product

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    Sampler,
    Subset,
    WeightedRandomSampler,
)

from common.data import digits_split
from common.data_parallel.bucketing import (
    LengthGroupedDistributedBatchSampler,
    padded_tokens,
    synthetic_lengths,
)
from common.data_parallel.samplers import (
    DistributedSamplerByHand,
    WeightedDistributedSampler,
    distributed_indices,
)
from common.harness.env import LessonError
from common.harness.ranks import all_gather_objects, print0
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main

NUM_CLASSES = 10


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0, help="sampler seed (>= 0)")
    p.add_argument(
        "--demo-size", type=int, default=11, help="dataset size in sections 1-2 (default 11)"
    )
    p.add_argument("--batch-size", type=int, default=2, help="batch size per process in section 2")
    p.add_argument(
        "--imbalance", type=float, default=0.05, help="class c keeps imbalance**(c/9) of its images"
    )
    p.add_argument("--seq-count", type=int, default=20000, help="synthetic sequences for bucketing")
    p.add_argument(
        "--seq-batch", type=int, default=32, help="sequences per batch per process (bucketing)"
    )
    p.add_argument("--pool-batches", type=int, default=50, help="batches per length-sorting pool")
    p.add_argument(
        "--data", default=None, help="digits .npz (default: the bundled data/digits.npz)"
    )
    p.add_argument(
        "--results", default=None, help="rank 0 writes the reported numbers here as JSON"
    )
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validate before any process group exists: every rank sees the same argv, so every rank fails alike.
    for name, low in (
        ("demo_size", 1),
        ("batch_size", 1),
        ("seq_count", 1),
        ("seq_batch", 2),
        ("pool_batches", 1),
        ("seed", 0),
    ):
        if getattr(args, name) < low:
            kind = {0: ">= 0", 1: "a positive integer"}.get(
                low, f">= {low} (1 sequence per batch has no padding)"
            )
            raise LessonError(
                f"--{name.replace('_', '-')} must be {kind}, got {getattr(args, name)}"
            )
    if not 0.0 < args.imbalance <= 1.0:
        raise LessonError(f"--imbalance must be in (0, 1], got {args.imbalance}")
    return args


# 1. DistributedSampler by hand ------------------------------------------------------------------------------
def count_matching_configs(seeds=(0, 7), epochs=(0, 1)) -> tuple[int, int]:
    """(matching, total) configurations (n, W, shuffle, drop_last, seed, epoch) on which the by-hand indices
    equal torch's DistributedSampler on every rank (n = 0..12, W = 1..4)."""
    configs, match = (
        list(product(range(13), range(1, 5), (False, True), (False, True), seeds, epochs)),
        0,
    )
    for n, w, shuffle, drop_last, seed, epoch in configs:
        ok = True
        for r in range(w):
            ref = DistributedSampler(range(n), w, r, shuffle, seed, drop_last)
            ref.set_epoch(epoch)
            mine = distributed_indices(n, w, r, shuffle, seed, epoch, drop_last).tolist()
            ok &= list(ref) == mine and len(ref) == len(mine)
        match += ok
    return match, len(configs)


# 2. __len__: the blog-post sampler (the counter-example, myth 5) and the rule for when ranks' steps differ
class BlogShardSampler(Sampler):
    """What many blog posts write -- the counter-example, not for use: it strides without padding (ranks hold
    ceil(n/W) or floor(n/W) samples), and __len__ returns the dataset's length, not this rank's."""

    def __init__(self, n: int, num_replicas: int, rank: int):
        self.n, self.num_replicas, self.rank = n, num_replicas, rank

    def __iter__(self):
        return iter(range(self.rank, self.n, self.num_replicas))

    def __len__(self) -> int:
        return self.n  # the bug: the dataset's length, not this rank's


def len_vs_yield(sampler: Sampler, batch_size: int, drop_last: bool) -> dict:
    """What a DataLoader over `sampler` claims (len) and what it yields, in batches."""
    loader = DataLoader(range(10**9), batch_size=batch_size, sampler=sampler, drop_last=drop_last)
    return {"len": len(loader), "yielded": sum(1 for _ in loader)}


def blog_steps_differ(n: int, world_size: int, batch_size: int, drop_last: bool) -> bool:
    """The rule: an unpadded stride sampler leaves ranks with different step counts exactly when W does not
    divide n AND ceil(n/W) and floor(n/W) samples make different numbers of batches of batch_size."""

    def batches(count: int) -> int:
        return count // batch_size if drop_last else -(-count // batch_size)

    return n % world_size != 0 and batches(-(-n // world_size)) != batches(n // world_size)


def step_rule_mismatches(max_n: int = 40) -> tuple[int, int]:
    """(configurations where the rule disagrees with the batches BatchSampler yields per rank, total)."""
    configs, bad = list(product(range(1, max_n + 1), range(1, 5), range(1, 5), (False, True))), 0
    for n, w, b, dl in configs:
        steps = {len(list(BatchSampler(BlogShardSampler(n, w, r), b, dl))) for r in range(w)}
        bad += (len(steps) > 1) != blog_steps_differ(n, w, b, dl)
    return bad, len(configs)


# 3-4. Data for weighted sampling and bucketing --------------------------------------------------------------
def imbalanced_subset(train_set, imbalance: float, seed: int) -> tuple[Subset, torch.Tensor]:
    """Keep fraction imbalance**(c/9) of class c (all of class 0, `imbalance` of class 9), at least 2 each.
    Returns (Subset, labels (m,) int64). The choice is seeded, hence identical on every rank."""
    y = train_set.tensors[1]
    g = torch.Generator().manual_seed(seed)
    keep = []
    for c in range(NUM_CLASSES):
        idx = torch.nonzero(y == c).flatten()
        k = max(2, round(len(idx) * imbalance ** (c / (NUM_CLASSES - 1))))
        keep.append(idx[torch.randperm(len(idx), generator=g)[:k]])
    keep = torch.sort(torch.cat(keep)).values
    return Subset(train_set, keep.tolist()), y[keep]


def class_hist(labels: torch.Tensor, indices: list[int]) -> list[int]:
    return torch.bincount(
        labels[torch.as_tensor(indices, dtype=torch.int64)], minlength=NUM_CLASSES
    ).tolist()


def interleave(streams: list[list[int]]) -> list[int]:
    """Rank streams back into the global order: position k came from rank k % W."""
    return [streams[k % len(streams)][k // len(streams)] for k in range(sum(map(len, streams)))]


def which_indices(info, args, report: Report) -> None:
    """1. Which indices this rank reads in epochs 0 and 1, from PyTorch's sampler and from ours."""
    W, rank, n, seed = info.world_size, info.rank, args.demo_size, args.seed
    print0(
        f"\n1. DistributedSampler, {n} samples over {W} rank(s): seed + epoch permutation, pad, stride"
    )
    mine = []
    for epoch in (0, 1):
        ref = DistributedSampler(range(n), W, rank, shuffle=True, seed=seed)
        ref.set_epoch(epoch)  # permutation seed = seed + epoch, the same on every rank
        mine.append((list(ref), distributed_indices(n, W, rank, True, seed, epoch).tolist()))
    per_rank = all_gather_objects(mine, info)
    indices = report.record(
        "indices", [[f[e][0] for f in per_rank] for e in (0, 1)]
    )  # [epoch][rank]
    print0("\n".join(f"  epoch {e} rank {r}: {indices[e][r]}" for e in (0, 1) for r in range(W)))
    report.claim(
        "padding_repeats",
        sum(map(len, indices[0])) - n,
        "==",
        (-n) % W,
        "  padding: the ranks read {value} index(es) twice, (-n) mod W = {bound}",
    )
    # 1 index has one order; 2..4 (2 or 6 or 24 orders) repeat by chance (1 in 2 seeds for n = 2)
    if n >= 5:
        report.claim(
            "set_epoch_changes_permutation",
            int(indices[0] != indices[1]),
            "==",
            1,
            "  set_epoch(1) changes the permutation: {value}",
        )
    same = int(all(a == b for f in per_rank for a, b in f))
    report.claim(
        "by_hand_equals_torch_this_run",
        same,
        "==",
        1,
        "  by-hand sampler == torch DistributedSampler on every rank of this run: {value}",
    )
    match, total = count_matching_configs(seeds=(seed, seed + 7))
    report.record("configs_total", total)
    report.claim(
        "by_hand_equals_torch_configs",
        total - match,
        "==",
        0,
        f"  ... and on {match} of {total} configurations (n 0..12, W 1..4, shuffle, drop_last, "
        "2 seeds, 2 epochs): {value} mismatches",
    )


def len_per_rank(info, args, report: Report) -> None:
    """2. __len__ (myth 5): DataLoader len vs batches yielded on THIS rank, ours and the blog sampler."""
    W, rank, n, b, seed = info.world_size, info.rank, args.demo_size, args.batch_size, args.seed
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
    rows = {
        k: [m[k] for m in all_gather_objects(mine, info)] for k in mine
    }  # name -> [rank 0's, ...]
    for name, cells in rows.items():
        print0(
            f"  {name:<18} "
            + "  ".join(f"r{r}: {c['len']:>2}/{c['yielded']:>2}" for r, c in enumerate(cells))
        )
    report.record("len_check", rows)
    ours = [rows[k] for k in ("by_hand", "by_hand_drop_last", "length_grouped")]
    report.claim(
        "our_len_equals_yield",
        sum(c["len"] != c["yielded"] for cells in ours for c in cells),
        "==",
        0,
        "  our samplers: ranks where len(DataLoader) != batches yielded: {value}",
    )
    uneven = sum(len({c["yielded"] for c in cells}) > 1 for cells in ours)
    report.claim(
        "our_steps_equal_on_every_rank",
        uneven,
        "==",
        0,
        "  our samplers: samplers whose ranks run different step counts: {value}",
    )
    report.claim(
        "blog_len_is_dataset_batches",
        rows["blog"][0]["len"],
        "==",
        math.ceil(n / b),
        "  the blog sampler says len(DataLoader) = {value} = ceil(n / batch) (the dataset's)",
    )
    report.claim(
        "blog_yields_rank_share",
        rows["blog"][0]["yielded"],
        "==",
        math.ceil(math.ceil(n / W) / b),
        "  ... and yields {value} batches on rank 0 = ceil(ceil(n / W) / batch) (this rank's)",
    )
    for key, dl in (("blog", False), ("blog_drop_last", True)):
        steps = [c["yielded"] for c in rows[key]]
        report.claim(
            f"{key}_steps_differ_as_the_rule_says",
            int(len(set(steps)) > 1),
            "==",
            int(blog_steps_differ(n, W, b, dl)),
            f"  blog sampler, drop_last={dl}: steps per rank {steps}; they differ: {{value}}",
        )
    bad, total = step_rule_mismatches()
    report.claim(
        "blog_step_rule_exact",
        bad,
        "==",
        0,
        f"  blog_steps_differ (the rule) vs {total} "
        "configurations (n 1..40, W 1..4, batch 1..4, drop_last): {value} mismatches",
    )
    uneven = [k for k in range(1, 17) if blog_steps_differ(k, W, b, False)]
    report.value(
        "blog_sizes_with_uneven_steps",
        uneven,
        f"  W={W}, batch {b}, no drop_last: the sizes 1..16 whose ranks' steps differ are {{value}}",
    )


def weighted_sampling(info, args, report: Report) -> None:
    """3. Class histograms per rank: plain DistributedSampler vs weights 1 / class count."""
    W, rank, seed = info.world_size, info.rank, args.seed
    subset, labels = imbalanced_subset(
        digits_split(path=args.data)[0], args.imbalance, seed
    )  # of 1438
    class_count = torch.bincount(labels, minlength=NUM_CLASSES)
    print0(
        f"\n3. Weighted sampling, imbalanced digits subset of {len(labels)} images "
        f"(class counts {class_count.tolist()})"
    )
    report.claim(
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
    per_rank = all_gather_objects(mine, info)
    hists = {k: [f[k] for f in per_rank] for k in ("plain", "weighted")}
    ratio = {k: [max(h) / max(min(h), 1) for h in v] for k, v in hists.items()}
    print0(
        "\n".join(
            f"  {k:<8} rank {r}: {h}  max/min {ratio[k][r]:.2f}"
            for k in hists
            for r, h in enumerate(hists[k])
        )
    )
    report.record(
        "weighted", {"class_count": class_count.tolist(), "hist": hists, "max_min_ratio": ratio}
    )
    report.claim(
        "plain_stays_imbalanced",
        min(ratio["plain"]),
        ">=",
        5,
        "  plain: smallest max/min {value:.2f}",
    )
    # all ranks' draws: ~m/W per rank is noisier (W = 4: ~5)
    union_hist = torch.tensor(hists["weighted"]).sum(0)
    report.claim(
        "weighted_rebalances",
        (union_hist.max() / union_hist.min().clamp_min(1)).item(),
        "<=",
        3,
        f"  weighted, all {W} rank(s) together: max/min {{value:.2f}}",
    )
    report.claim(
        "weighted_deterministic",
        int(all(f["deterministic"] for f in per_rank)),
        "==",
        1,
        "  weighted: the same seed gives the same stream: {value}",
    )
    report.claim(
        "weighted_set_epoch_changes_order",
        int(all(f["epoch_changes_order"] for f in per_rank)),
        "==",
        1,
        "  weighted: set_epoch(1) changes the order: {value}",
    )
    if W > 1:
        report.claim(
            "weighted_ranks_differ",
            len({tuple(f["indices"]) for f in per_rank}),
            "==",
            W,
            "  weighted: distinct rank streams {value}",
        )
    weighted_unions(report, W, seed, weights, per_rank)


def weighted_unions(
    report: Report, W: int, seed: int, weights: torch.Tensor, per_rank: list
) -> None:
    """3, continued: the ranks' streams interleaved against WeightedRandomSampler's draw in one process."""

    def g():  # seed + epoch 0, as the sampler's
        return torch.Generator().manual_seed(seed)

    union = interleave([f["indices"] for f in per_rank])
    same = int(union == list(WeightedRandomSampler(weights, len(union), True, generator=g())))
    report.claim(
        "weighted_union_equals_torch_draw",
        same,
        "==",
        1,
        "  with replacement, ranks interleaved "
        "== WeightedRandomSampler's draw in one process: {value}",
    )
    # Without replacement, num_samples = m = 50 W + 1 draws fill W * 51 positions: the last W - 1 repeat the
    # start.
    m = 50 * W + 1
    union = interleave([f["no_replacement"] for f in per_rank])
    drawn = list(WeightedRandomSampler(weights, m, False, generator=g()))
    padded = int(union[:m] == drawn and union[m:] == union[: len(union) - m])
    report.claim(
        "weighted_no_replacement_is_torch_draw_plus_padding",
        padded,
        "==",
        1,
        f"  without replacement, {m} draws: ranks interleaved == WeightedRandomSampler({m}) + "
        "padding: {value}",
    )
    whole = int(union == list(WeightedRandomSampler(weights, len(union), False, generator=g())))
    report.claim(
        "weighted_no_replacement_equals_torch_total_draw_only_if_w_divides",
        whole,
        "==",
        int(m % W == 0),
        f"  ... == its draw of all {len(union)} positions: {{value}} ({m} mod {W} = {m % W})",
    )


def bucketing(info, args, report: Report) -> None:
    """4. Padded tokens of random batches (DistributedSampler, then consecutive seq_batch chunks, as
    DataLoader(batch_size=...) does) vs length-grouped batches, over this rank's epoch 0."""
    W, rank, seed = info.world_size, info.rank, args.seed
    print0(
        f"\n4. Bucketing: {args.seq_count} sequences (log-normal lengths), {args.seq_batch} per batch "
        "per rank"
    )
    lengths = synthetic_lengths(args.seq_count, seed)
    rand_idx = list(DistributedSampler(range(args.seq_count), W, rank, shuffle=True, seed=seed))
    rand_batches = [
        rand_idx[i : i + args.seq_batch] for i in range(0, len(rand_idx), args.seq_batch)
    ]
    bucket = LengthGroupedDistributedBatchSampler(
        lengths, args.seq_batch, W, rank, seed, args.pool_batches
    )
    bucket_batches = list(bucket)
    mine = [
        *padded_tokens(rand_batches, lengths),
        *padded_tokens(bucket_batches, lengths),
        len(bucket_batches),
        len(bucket),
    ]
    per_rank = all_gather_objects(mine, info)
    real_r, pad_r, real_b, pad_b = (
        sum(f[i] for f in per_rank) for i in range(4)
    )  # (sum, count) over ranks
    frac_r, frac_b = 1 - real_r / pad_r, 1 - real_b / pad_b
    report.record("padded_fraction_random", frac_r)
    report.value(
        "padded_fraction_bucketed",
        frac_b,
        f"  padded-token fraction: random batches {frac_r:.4f}, length-grouped {{value:.4f}}",
    )
    report.claim(
        "bucketing_cuts_padding",
        1 - frac_b / frac_r,
        ">=",
        0.85,
        f"  tokens computed {pad_r} -> {pad_b}: padding cut by {{value:.1%}}",
    )
    report.claim(
        "bucketing_below_half_of_random",
        frac_b / frac_r,
        "<=",
        0.5,
        "  length-grouped / random padded fraction: {value:.3f}",
    )
    report.claim(
        "bucketing_same_batches_every_rank",
        len({(f[4], f[5]) for f in per_rank}),
        "==",
        1,
        f"  batches per rank {[f[4] for f in per_rank]}, len {[f[5] for f in per_rank]}: "
        "distinct (yielded, len) pairs {value}",
    )
    report.record(
        "lengths_hist", np.histogram(lengths.numpy(), bins=32, range=(0, 512))[0].tolist()
    )


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        report = Report(info)
        report.value(
            "world_size",
            info.world_size,
            f"world_size {{value}}  backend {info.backend or 'none'}  seed {args.seed}",
        )
        which_indices(info, args, report)
        len_per_rank(info, args, report)
        weighted_sampling(info, args, report)
        bucketing(info, args, report)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
