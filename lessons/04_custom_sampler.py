"""Lesson 04: distributed samplers -- how DistributedSampler works, and custom ones done right.

Run it:

    python lessons/04_custom_sampler.py                                    # one process (world of 1)
    torchrun --standalone --nproc_per_node=2 lessons/04_custom_sampler.py  # 2 processes, gloo on CPU
    torchrun --standalone --nproc_per_node=2 lessons/04_custom_sampler.py --bench-size 0   # skip the benchmark

The samplers themselves live in common/samplers.py, where later lessons import them.

What to look for:
1. DistributedSampler index by index: every rank computes the SAME permutation from seed + epoch, pads it by
   repeating its start (or drops the tail with drop_last) and takes every world_size-th index from its rank.
   The re-implementation matches PyTorch's indices on every configuration tried.
2. Myth: "a custom sampler's __len__ returns the dataset's length". It must return what THIS rank yields; the
   blog-post sampler reports 11 and yields 6 or 5. Two bugs hide here: the wrong __len__ makes len(DataLoader),
   LR schedules and progress bars wrong; the missing padding makes ranks yield different counts, so with
   drop_last batching its ranks run 3 and 2 steps, and under DDP the longer rank waits in an all-reduce that the
   other never joins. Our samplers fix both.
3. Weighted sampling on an imbalanced subset of the digits: per-rank class histograms before (about 20:1) and
   after (roughly flat); each rank's stream is deterministic and different from the other ranks'.
4. Length-grouped batches: the padded-token fraction falls from 0.75 to 0.07 (cut by 90%, far more than half),
   with the same number of batches on every rank.
5. Evaluation: the unpadded sampler gives shards of 180 and 179 test images and, with (sum, count) reduction,
   the same loss and accuracy as one process and as common.metrics.evaluate; counting DistributedSampler's
   padding would count 360 images.
6. Uneven shards (rank r holds 4 + r batches): under Join every rank finishes with identical parameters after
   4 and 5 optimizer steps; the plain loop leaves rank 1 waiting in an all-reduce that only a short
   process-group timeout ends.
7. Seeding: the same seed on every rank gives every rank the same augmentation streams (worker w on rank 0 =
   worker w on rank 1); loader_generator(seed, rank) gives 4 pairwise different streams, identical on rerun.
   PyTorch already seeds torch, numpy and random differently in each worker of one rank.
8. [perf]: building and iterating one epoch of each sampler over 10^6 samples, per rank.
"""
from __future__ import annotations

import argparse
import math
import random
import time
from contextlib import nullcontext
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import (DataLoader, Dataset, DistributedSampler, Sampler, Subset, WeightedRandomSampler,
                              get_worker_info)

from common.checkpoint import write_results
from common.data import digits_split
from common.ranks import all_reduce_sum, gather_to_rank0, max_param_diff_across_ranks, print0
from common.session import LessonError, add_distributed_args, barrier, distributed_session, run_main, set_seed
from common.metrics import evaluate
from common.models import DigitsCNN
from common.samplers import (DistributedSamplerByHand, LengthGroupedDistributedBatchSampler,
                             UnpaddedDistributedSampler, WeightedDistributedSampler, distributed_indices,
                             loader_generator, padded_tokens)

NUM_CLASSES = 10


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0, help="sampler seed, model init, augmentation seed (>= 0)")
    p.add_argument("--demo-size", type=int, default=11, help="dataset size in the index pictures (default 11)")
    p.add_argument("--batch-size", type=int, default=2, help="batch size per process in the __len__ demo")
    p.add_argument("--imbalance", type=float, default=0.05,
                   help="kept fraction of the rarest digit class; class c keeps imbalance**(c/9) (default 0.05)")
    p.add_argument("--seq-count", type=int, default=20000, help="synthetic sequences for bucketing")
    p.add_argument("--seq-batch", type=int, default=32, help="sequences per batch per process (bucketing)")
    p.add_argument("--pool-batches", type=int, default=50, help="batches per length-sorting pool")
    p.add_argument("--join-batches", type=int, default=4, help="rank r trains on join-batches + r batches")
    p.add_argument("--join-batch-size", type=int, default=16, help="samples per batch in the Join demo")
    p.add_argument("--hang-timeout-s", type=float, default=2.0,
                   help="process-group timeout that ends the plain loop's wait (default %(default)s s)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank in the seeding demo")
    p.add_argument("--aug-samples", type=int, default=8, help="samples per rank in the seeding demo")
    p.add_argument("--bench-size", type=int, default=10**6, help="samples in the [perf] benchmark; 0 skips it")
    p.add_argument("--data", default=None, help="digits .npz (default: the bundled data/digits.npz)")
    p.add_argument("--results", default=None, help="rank 0 writes the reported numbers here as JSON")
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validate before any process group exists: every rank sees the same argv, so every rank fails alike.
    positive = {"--demo-size": args.demo_size, "--batch-size": args.batch_size, "--seq-count": args.seq_count,
                "--seq-batch": args.seq_batch, "--pool-batches": args.pool_batches,
                "--join-batches": args.join_batches, "--join-batch-size": args.join_batch_size,
                "--workers": args.workers, "--aug-samples": args.aug_samples}
    for name, value in positive.items():
        if value < 1:
            raise LessonError(f"{name} must be a positive integer, got {value}")
    if args.seed < 0:
        raise LessonError(f"--seed must be >= 0, got {args.seed}")
    if not 0.0 < args.imbalance <= 1.0:
        raise LessonError(f"--imbalance must be in (0, 1], got {args.imbalance}")
    if args.bench_size < 0:
        raise LessonError(f"--bench-size must be >= 0, got {args.bench_size}")
    if not 0.0 < args.hang_timeout_s < args.timeout_s:
        raise LessonError(f"--hang-timeout-s must be in (0, --timeout-s={args.timeout_s}), got {args.hang_timeout_s}")
    return args


# ---------------------------------------------------------------------------------------------------------------
# 1-2. DistributedSampler by hand, and the blog-post sampler whose __len__ is wrong
# ---------------------------------------------------------------------------------------------------------------
def count_matching_configs(seeds=(0, 7), epochs=(0, 1)) -> tuple[int, int]:
    """(matching, total) configurations (n, W, shuffle, drop_last, seed, epoch) on which the by-hand indices
    equal torch's DistributedSampler on every rank (n = 0..12, W = 1..4)."""
    match = total = 0
    for n in range(13):
        for w in range(1, 5):
            for shuffle in (False, True):
                for drop_last in (False, True):
                    for seed in seeds:
                        for epoch in epochs:
                            ok = True
                            for r in range(w):
                                ref = DistributedSampler(range(n), w, r, shuffle, seed, drop_last)
                                ref.set_epoch(epoch)
                                mine = distributed_indices(n, w, r, shuffle, seed, epoch, drop_last).tolist()
                                ok &= list(ref) == mine and len(ref) == len(mine)
                            match += ok
                            total += 1
    return match, total


class BlogShardSampler(Sampler):
    """What many blog posts write -- kept here as the counter-example (myth 5), not for use.

    It shards by stride but does not pad, so ranks hold different numbers of samples, and __len__ returns the
    dataset's length instead of this rank's count: len(DataLoader) and every schedule built on it are wrong.
    """

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


# ---------------------------------------------------------------------------------------------------------------
# 3. Weighted sampling on an imbalanced subset of the digits
# ---------------------------------------------------------------------------------------------------------------
def imbalanced_subset(train_set, imbalance: float, seed: int) -> tuple[Subset, torch.Tensor]:
    """Keep fraction imbalance**(c/9) of class c (all of class 0, `imbalance` of class 9), at least 2 each.

    Returns (Subset, labels (m,) int64). The choice is seeded, hence identical on every rank.
    """
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
    return torch.bincount(labels[torch.as_tensor(indices, dtype=torch.int64)], minlength=NUM_CLASSES).tolist()


# ---------------------------------------------------------------------------------------------------------------
# 4. Variable-length sequences
# ---------------------------------------------------------------------------------------------------------------
def synthetic_lengths(n: int, seed: int) -> torch.Tensor:
    """n sequence lengths, log-normal (median e^4 = 55 tokens, long tail), clipped to [4, 512]; int64 (n,)."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(np.clip(np.round(rng.lognormal(4.0, 0.8, n)), 4, 512).astype(np.int64))


# ---------------------------------------------------------------------------------------------------------------
# 7. Seeding data loading
# ---------------------------------------------------------------------------------------------------------------
class RandomAugmentStream(Dataset):
    """Each item records the random draws an augmentation would make: one from torch, numpy and `random`."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = get_worker_info()
        return (info.id if info else -1, torch.rand(()).item(), float(np.random.rand()), random.random())


def augmentation_streams(n: int, workers: int, generator: torch.Generator | None) -> dict[int, list]:
    """{worker id: [(torch, numpy, random) draws, rounded to 9 decimals], in the order that worker made them}."""
    loader = DataLoader(RandomAugmentStream(n), batch_size=1, num_workers=workers, generator=generator,
                        collate_fn=lambda batch: batch[0])
    streams: dict[int, list] = {}
    for wid, *draws in loader:
        streams.setdefault(wid, []).append([round(d, 9) for d in draws])
    return streams


def seeding_demo(args, info) -> dict:
    # The bug: every rank seeds the global RNG with the same number (as lesson 03 rightly does for the model) and
    # builds its DataLoader without a generator, so every rank draws the same base_seed for its workers.
    set_seed(args.seed)
    same = augmentation_streams(args.aug_samples, args.workers, None)
    # The fix: a generator seeded from (seed, rank); run twice to show it reproduces.
    fixed = augmentation_streams(args.aug_samples, args.workers, loader_generator(args.seed, info.rank))
    rerun = augmentation_streams(args.aug_samples, args.workers, loader_generator(args.seed, info.rank))
    return {"same_seed": same, "rank_seed": fixed, "rank_seed_rerun": rerun}


def stream_summary(per_rank: list[dict], key: str) -> dict:
    """Distinctness of the (rank, worker) streams of one configuration, per library and together."""
    streams = {f"r{r}w{w}": s for r, d in enumerate(per_rank) for w, s in sorted(d[key].items())}
    names = sorted(streams)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    identical = [f"{a}={b}" for a, b in pairs if streams[a] == streams[b]]
    # Per library: within one rank, do the workers differ? (PyTorch seeds each worker's torch, numpy, random.)
    libs = {}
    for j, lib in enumerate(("torch", "numpy", "random")):
        col = {k: [d[j] for d in v] for k, v in streams.items()}
        libs[lib] = len({tuple(v) for v in col.values()})
    return {"streams": streams, "num_streams": len(names), "num_distinct": len({str(streams[k]) for k in names}),
            "identical_pairs": identical, "distinct_per_library": libs}


# ---------------------------------------------------------------------------------------------------------------
# 8. Benchmark
# ---------------------------------------------------------------------------------------------------------------
def bench(n: int, info, seed: int) -> dict:
    """Seconds to build each sampler over n samples and iterate one epoch on this rank (epoch 1)."""
    w, r = info.world_size, info.rank
    lengths = synthetic_lengths(n, seed)
    weights = torch.rand(n, generator=torch.Generator().manual_seed(seed)) + 0.1
    makers = {
        "torch DistributedSampler": lambda: DistributedSampler(range(n), w, r, True, seed),
        "DistributedSamplerByHand": lambda: DistributedSamplerByHand(n, w, r, True, seed),
        "UnpaddedDistributedSampler": lambda: UnpaddedDistributedSampler(n, w, r, True, seed),
        "WeightedDistributedSampler": lambda: WeightedDistributedSampler(weights, w, r, seed=seed),
        "LengthGroupedDistributedBatchSampler": lambda: LengthGroupedDistributedBatchSampler(lengths, 32, w, r, seed),
    }
    out = {}
    for name, make in makers.items():
        t0 = time.perf_counter()
        s = make()
        s.set_epoch(1)
        count = sum(1 for _ in s)
        out[name] = {"seconds": time.perf_counter() - t0, "yielded": count}
    return out


# ---------------------------------------------------------------------------------------------------------------
def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        W, rank = info.world_size, info.rank
        facts: dict = {"rank": rank}
        results: dict = {"world_size": W, "backend": info.backend, "seed": args.seed}

        # 1. Which indices this rank reads, epochs 0 and 1, from PyTorch's sampler and from ours.
        n = args.demo_size
        facts["indices"], facts["by_hand_equal"] = [], True
        for epoch in (0, 1):
            ref = DistributedSampler(range(n), W, rank, shuffle=True, seed=args.seed)
            ref.set_epoch(epoch)  # permutation seed = seed + epoch, the same on every rank
            mine = DistributedSamplerByHand(n, W, rank, shuffle=True, seed=args.seed)
            mine.set_epoch(epoch)
            facts["indices"].append(list(ref))
            facts["by_hand_equal"] &= list(ref) == list(mine)

        # 2. __len__ (myth 5): DataLoader len vs batches yielded on THIS rank, for our sampler and the blog one.
        b = args.batch_size
        facts["len_check"] = {
            "by_hand": len_vs_yield(DistributedSamplerByHand(n, W, rank, seed=args.seed), b, False),
            "by_hand_drop_last": len_vs_yield(DistributedSamplerByHand(n, W, rank, seed=args.seed), b, True),
            "blog": len_vs_yield(BlogShardSampler(n, W, rank), b, False),
            "blog_drop_last": len_vs_yield(BlogShardSampler(n, W, rank), b, True),
        }
        grouped = LengthGroupedDistributedBatchSampler(synthetic_lengths(n, args.seed), b, W, rank, args.seed)
        facts["len_check"]["length_grouped"] = {"len": len(grouped), "yielded": sum(1 for _ in grouped)}

        # 3. Weighted sampling: class histograms per rank, plain DistributedSampler vs weights 1 / class count.
        train_set, test_set = digits_split(path=args.data)  # (1438, 1, 8, 8) and (359, 1, 8, 8) on every rank
        subset, labels = imbalanced_subset(train_set, args.imbalance, args.seed)
        class_count = torch.bincount(labels, minlength=NUM_CLASSES)
        plain = DistributedSampler(subset, W, rank, shuffle=True, seed=args.seed)
        weighted = WeightedDistributedSampler(1.0 / class_count[labels].double(), W, rank, seed=args.seed)
        first = list(weighted)
        again = list(WeightedDistributedSampler(1.0 / class_count[labels].double(), W, rank, seed=args.seed))
        weighted.set_epoch(1)
        facts["weighted"] = {"hist_plain": class_hist(labels, list(plain)), "hist_weighted": class_hist(labels, first),
                             "indices": first, "deterministic": first == again,
                             "epoch_changes_order": list(weighted) != first}
        weighted.set_epoch(0)
        if rank == 0:  # the union over ranks is exactly PyTorch's WeightedRandomSampler draw (seed + epoch)
            g = torch.Generator().manual_seed(args.seed)
            facts["weighted"]["torch_draw"] = list(WeightedRandomSampler(weighted.weights, weighted.total_size,
                                                                         True, generator=g))

        # 4. Bucketing: padded tokens of random batches (DistributedSampler, then consecutive batch_size chunks,
        # what DataLoader(batch_size=...) does) vs length-grouped batches, over this rank's epoch 0.
        lengths = synthetic_lengths(args.seq_count, args.seed)
        rand_idx = list(DistributedSampler(range(args.seq_count), W, rank, shuffle=True, seed=args.seed))
        rand_batches = [rand_idx[i:i + args.seq_batch] for i in range(0, len(rand_idx), args.seq_batch)]
        bucket = LengthGroupedDistributedBatchSampler(lengths, args.seq_batch, W, rank, args.seed, args.pool_batches)
        bucket_batches = list(bucket)
        facts["bucketing"] = {"random_tokens": padded_tokens(rand_batches, lengths),
                              "bucket_tokens": padded_tokens(bucket_batches, lengths),
                              "random_batches": len(rand_batches), "bucket_batches": len(bucket_batches),
                              "bucket_len": len(bucket)}

        # 6. Uneven shards under Join. Rank r holds join_batches + r batches -- as when each rank reads its own
        # shard file and the files differ in size. BatchNorm is left out (norm="none") so that each step's only
        # collective is the gradient all-reduce; BatchNorm across ranks is lesson 05.
        set_seed(args.seed)
        raw_model = DigitsCNN(norm="none").to(info.device)
        model = DDP(raw_model) if info.distributed else raw_model
        # Plain SGD: Join keeps parameters in sync, not optimizer state (momentum would differ on the rank that
        # stopped early).
        optimizer = torch.optim.SGD(raw_model.parameters(), lr=0.05)
        nb = args.join_batches + rank
        shard = list(DistributedSampler(train_set, W, rank, shuffle=True, seed=args.seed))[:nb * args.join_batch_size]
        loader = DataLoader(Subset(train_set, shard), batch_size=args.join_batch_size)
        steps = 0
        # Join: a rank that runs out of batches "shadows" the others' all-reduces with zeros until all are done,
        # then the parameters of the last rank to finish are broadcast to everyone.
        with Join([model]) if info.distributed else nullcontext():
            for x, y in loader:
                loss = F.cross_entropy(model(x.to(info.device)), y.to(info.device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                steps += 1
        facts["join_steps"] = steps
        join_diff = max_param_diff_across_ranks(raw_model, info)

        # The same loop without Join, in a separate process group whose timeout is hang_timeout_s: the rank with
        # more batches waits in its extra step's all-reduce for a partner that never comes, until the timeout.
        hang = {"ran": info.distributed and W > 1}
        if hang["ran"]:
            pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.hang_timeout_s))
            set_seed(args.seed)
            plain_raw = DigitsCNN(norm="none").to(info.device)
            plain_model = DDP(plain_raw, process_group=pg)
            plain_steps, outcome, t0 = 0, "finished", time.perf_counter()
            try:
                for x, y in loader:
                    F.cross_entropy(plain_model(x.to(info.device)), y.to(info.device)).backward()
                    plain_steps += 1
            except RuntimeError as e:  # gloo: "Timed out waiting 2000ms for recv operation to complete"
                outcome = "timed out" if "timed out" in str(e).lower() else f"error: {type(e).__name__}"
            hang.update(steps=plain_steps, outcome=outcome, seconds=time.perf_counter() - t0)
            barrier(info)  # the default group (timeout --timeout-s): everyone continues together
        facts["hang"] = hang

        # 5. Evaluation without duplicates on the Join-trained model (identical on every rank). After 4-5 steps it
        # is still near chance (accuracy about 0.1): what matters here is that the three exact ways agree.
        model.eval()
        ev = UnpaddedDistributedSampler(test_set, W, rank)  # 180 and 179 of 359 test images with 2 ranks
        sums = [0.0, 0.0, 0.0]  # loss_sum, correct, count
        with torch.no_grad():
            for x, y in DataLoader(test_set, batch_size=128, sampler=ev):
                logits = raw_model(x.to(info.device))
                y = y.to(info.device)
                sums[0] += F.cross_entropy(logits, y, reduction="sum").item()
                sums[1] += (logits.argmax(1) == y).sum().item()
                sums[2] += len(y)
            facts["eval_count"] = int(sums[2])
            loss_sum, correct, count = all_reduce_sum(sums, info)  # sum (sum, count) pairs, divide once
            unpadded = {"loss": loss_sum / count, "accuracy": correct / count, "count": int(count)}
            # The mistake: DistributedSampler's padding counted as if it were data.
            naive = [0.0, 0.0, 0.0]
            for x, y in DataLoader(test_set, batch_size=128, sampler=DistributedSampler(test_set, W, rank,
                                                                                     shuffle=False)):
                logits = raw_model(x.to(info.device))
                y = y.to(info.device)
                naive[0] += F.cross_entropy(logits, y, reduction="sum").item()
                naive[1] += (logits.argmax(1) == y).sum().item()
                naive[2] += len(y)
            nl, nc, nn_ = all_reduce_sum(naive, info)
            x_all, y_all = test_set.tensors  # one process, the whole test set: the reference
            logits = raw_model(x_all.to(info.device))
            single = {"loss": F.cross_entropy(logits, y_all.to(info.device)).item(),
                      "accuracy": (logits.argmax(1).cpu() == y_all).double().mean().item(), "count": len(y_all)}
        metrics_eval = evaluate(model, test_set, info)  # common.metrics: padded sampler + padding mask

        # 7. Seeding data loading (DataLoader workers fork from this process: kept few and short).
        facts["seeding"] = seeding_demo(args, info)

        # 8. Benchmark (timings: [perf] lines only).
        facts["bench"] = bench(args.bench_size, info, args.seed) if args.bench_size else {}

        per_rank = gather_to_rank0(facts, info)
        if not info.master_process:
            write_results(args.results, results, info)
            return

        # ------------------------------- rank 0 reports, in rank order -------------------------------
        print0(f"world_size {W}  backend {info.backend or 'none'}  device {info.device.type}  seed {args.seed}")
        print0(f"\n1. DistributedSampler, {n} samples over {W} rank(s): seed + epoch permutation, pad, stride")
        for epoch in (0, 1):
            pad = W * math.ceil(n / W) - n
            print0(f"  epoch {epoch} ({pad} padding repeat(s)):")
            for f in per_rank:
                print0(f"    rank {f['rank']}: {f['indices'][epoch]}")
        match, total = count_matching_configs(seeds=(args.seed, args.seed + 7))
        by_hand_all = all(f["by_hand_equal"] for f in per_rank)
        print0(f"  by-hand sampler == torch DistributedSampler on this run's ranks: {by_hand_all}; "
               f"on {match} of {total} configurations (n 0..12, W 1..4, shuffle, drop_last, 2 seeds, 2 epochs)")

        print0(f"\n2. __len__ per rank: DataLoader(batch_size={b}) over {n} samples, len vs batches yielded")
        len_rows = {}
        for name in ("by_hand", "by_hand_drop_last", "length_grouped", "blog", "blog_drop_last"):
            rows = [f["len_check"][name] for f in per_rank]
            len_rows[name] = rows
            cells = "  ".join(f"r{r}: {c['len']:>2}/{c['yielded']:>2}" for r, c in enumerate(rows))
            print0(f"  {name:<18} len/yielded  {cells}")
        blog_steps = [c["yielded"] for c in len_rows["blog_drop_last"]]
        print0(f"  the blog sampler reports len {len_rows['blog'][0]['len']} batches and yields "
               f"{[c['yielded'] for c in len_rows['blog']]}; with drop_last its ranks run {blog_steps} steps"
               f"{' -> DDP would hang' if len(set(blog_steps)) > 1 else ''}")

        print0(f"\n3. Weighted sampling, imbalanced digits subset of {len(labels)} images "
               f"(class counts {class_count.tolist()})")
        hists = {"plain": [f["weighted"]["hist_plain"] for f in per_rank],
                 "weighted": [f["weighted"]["hist_weighted"] for f in per_rank]}
        ratio = {k: [max(h) / max(min(h), 1) for h in v] for k, v in hists.items()}
        for k in ("plain", "weighted"):
            for r, h in enumerate(hists[k]):
                print0(f"  {k:<8} rank {r}: {h}  max/min {ratio[k][r]:.2f}")
        streams = [f["weighted"]["indices"] for f in per_rank]
        interleaved = [streams[i % W][i // W] for i in range(W * len(streams[0]))]
        union_equal = interleaved == per_rank[0]["weighted"]["torch_draw"]
        distinct_streams = len({tuple(s) for s in streams}) == W
        print0(f"  deterministic: {all(f['weighted']['deterministic'] for f in per_rank)}  "
               f"set_epoch changes order: {all(f['weighted']['epoch_changes_order'] for f in per_rank)}  "
               f"ranks' streams differ: {distinct_streams}  "
               f"union == WeightedRandomSampler's draw: {union_equal}")

        print0(f"\n4. Bucketing: {args.seq_count} sequences (log-normal lengths), {args.seq_batch} per batch per rank")
        real_r = sum(f["bucketing"]["random_tokens"][0] for f in per_rank)
        pad_r = sum(f["bucketing"]["random_tokens"][1] for f in per_rank)
        real_b = sum(f["bucketing"]["bucket_tokens"][0] for f in per_rank)
        pad_b = sum(f["bucketing"]["bucket_tokens"][1] for f in per_rank)
        frac_r, frac_b = 1 - real_r / pad_r, 1 - real_b / pad_b
        cut = 1 - frac_b / frac_r if frac_r else 0.0
        print0(f"  padded-token fraction: random batches {frac_r:.4f}  length-grouped {frac_b:.4f}  "
               f"(cut by {cut:.1%}; tokens computed {pad_r} -> {pad_b})")
        print0(f"  batches per rank: random {[f['bucketing']['random_batches'] for f in per_rank]}  "
               f"length-grouped {[f['bucketing']['bucket_batches'] for f in per_rank]} "
               f"(len {[f['bucketing']['bucket_len'] for f in per_rank]})")

        print0(f"\n5. Evaluation on {len(test_set)} test images, shards {[f['eval_count'] for f in per_rank]}")
        print0(f"  unpadded sampler + (sum, count): loss {unpadded['loss']:.6f}  acc {unpadded['accuracy']:.6f}  "
               f"count {unpadded['count']}")
        print0(f"  common.metrics.evaluate:         loss {metrics_eval['loss']:.6f}  "
               f"acc {metrics_eval['accuracy']:.6f}  count {metrics_eval['count']}")
        print0(f"  one process, whole test set:     loss {single['loss']:.6f}  acc {single['accuracy']:.6f}  "
               f"count {single['count']}")
        print0(f"  padding counted as data:         loss {nl / nn_:.6f}  acc {nc / nn_:.6f}  count {int(nn_)}")

        print0(f"\n6. Uneven shards: rank r holds {args.join_batches} + r batches of {args.join_batch_size}")
        join_steps = [f["join_steps"] for f in per_rank]
        print0(f"  with Join: optimizer steps per rank {join_steps}, all finished, "
               f"max parameter difference across ranks {join_diff:.1e}")
        hangs = [f["hang"] for f in per_rank]
        if hangs[0]["ran"]:
            for r, h in enumerate(hangs):
                what = ("finished its loop" if h["outcome"] == "finished" else
                        f"{h['outcome']} after the {args.hang_timeout_s:g} s process-group timeout")
                print0(f"  without Join: rank {r} ran {h['steps']} full step(s), then {what}")
            left = ", ".join(f"{h['seconds']:.2f}" for h in hangs)
            print0(f"[perf] without Join, seconds until each rank left the loop: {left}")
        else:
            print0("  without Join: needs torchrun with at least 2 processes (skipped)")

        print0(f"\n7. Seeding: {W} rank(s) x {args.workers} DataLoader worker(s), {args.aug_samples} samples per rank")
        seeding = {k: stream_summary([f["seeding"] for f in per_rank], k)
                   for k in ("same_seed", "rank_seed", "rank_seed_rerun")}
        rerun_identical = seeding["rank_seed"]["streams"] == seeding["rank_seed_rerun"]["streams"]
        for k, label in (("same_seed", "same seed on every rank"), ("rank_seed", "loader_generator(seed, rank)")):
            s = seeding[k]
            print0(f"  {label:<30} distinct streams {s['num_distinct']}/{s['num_streams']}  "
                   f"identical pairs {s['identical_pairs'] or 'none'}  per library {s['distinct_per_library']}")
        print0(f"  rerun with the same seed reproduces every stream: {rerun_identical}")

        if args.bench_size:
            for name in per_rank[0]["bench"]:
                secs = [f["bench"][name]["seconds"] for f in per_rank]
                print0(f"[perf] {name:<38} {args.bench_size} samples: build + 1 epoch per rank "
                       f"{', '.join(f'{s:.3f}' for s in secs)} s")

        results.update({
            "demo_size": n, "batch_size": b, "indices": [[f["indices"][e] for f in per_rank] for e in (0, 1)],
            "by_hand_equal_this_run": by_hand_all, "configs_matched": match, "configs_total": total,
            "len_check": len_rows,
            "weighted": {"class_count": class_count.tolist(), "subset_size": len(labels), "hist": hists,
                         "max_min_ratio": ratio, "union_equals_torch": union_equal,
                         "deterministic": all(f["weighted"]["deterministic"] for f in per_rank),
                         "epoch_changes_order": all(f["weighted"]["epoch_changes_order"] for f in per_rank),
                         "streams_differ": distinct_streams},
            "bucketing": {"padded_fraction_random": frac_r, "padded_fraction_bucketed": frac_b, "cut": cut,
                          "tokens_random": pad_r, "tokens_bucketed": pad_b,
                          "random_batches": [f["bucketing"]["random_batches"] for f in per_rank],
                          "bucket_batches": [f["bucketing"]["bucket_batches"] for f in per_rank],
                          "bucket_len": [f["bucketing"]["bucket_len"] for f in per_rank],
                          "lengths_hist": np.histogram(lengths.numpy(), bins=32, range=(0, 512))[0].tolist()},
            "eval": {"shards": [f["eval_count"] for f in per_rank], "unpadded": unpadded,
                     "metrics_evaluate": metrics_eval, "single_process": single,
                     "padded_as_data": {"loss": nl / nn_, "accuracy": nc / nn_, "count": int(nn_)}},
            "join": {"steps": join_steps, "max_param_diff": join_diff, "hang": hangs,
                     "hang_timeout_s": args.hang_timeout_s},
            "seeding": {**seeding, "rerun_identical": rerun_identical, "workers": args.workers},
            "perf": {name: [f["bench"][name]["seconds"] for f in per_rank] for name in per_rank[0]["bench"]},
            "bench_size": args.bench_size,
        })
        write_results(args.results, results, info)


if __name__ == "__main__":
    run_main(main)
