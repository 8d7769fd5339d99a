"""Speed of the samplers of lesson 04: build each over n samples and iterate one epoch on one rank.

    python benchmarks/sampler_speed.py                       # n = 10^6, rank 0 of a world of 2
    python benchmarks/sampler_speed.py --size 100000 --world-size 4 --rank 3

No process group is needed: every sampler takes (num_replicas, rank). Each sampler is timed --repeats times
(default 3) and the median is printed on a `[perf]` line with the count it yielded. What the numbers mean: every
rank builds the whole epoch's permutation (or weighted draw) itself, so the cost per rank does not fall with
the world size; the weighted sampler's multinomial over 10^6 weights dominates (about 0.2 s on one core here).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import DistributedSampler

from common.data_parallel.bucketing import LengthGroupedDistributedBatchSampler, synthetic_lengths
from common.data_parallel.samplers import DistributedSamplerByHand, UnpaddedDistributedSampler
from common.data_parallel.weighted_sampler import WeightedDistributedSampler
from common.harness.results import PERF_PREFIX


def bench(n: int, world_size: int, rank: int, seed: int = 0, repeats: int = 3) -> dict:
    """{sampler name: {"seconds": median build + 1 epoch (epoch 1), "yielded": items this rank yielded}}."""
    w, r = world_size, rank
    lengths = synthetic_lengths(n, seed)
    weights = torch.rand(n, generator=torch.Generator().manual_seed(seed)) + 0.1
    makers = {
        "torch DistributedSampler": lambda: DistributedSampler(range(n), w, r, True, seed),
        "DistributedSamplerByHand": lambda: DistributedSamplerByHand(n, w, r, True, seed),
        "UnpaddedDistributedSampler": lambda: UnpaddedDistributedSampler(n, w, r, True, seed),
        "WeightedDistributedSampler": lambda: WeightedDistributedSampler(weights, w, r, seed=seed),
        "LengthGroupedDistributedBatchSampler": lambda: LengthGroupedDistributedBatchSampler(
            lengths, 32, w, r, seed
        ),
    }
    out = {}
    for name, make in makers.items():
        times, count = [], 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            s = make()
            s.set_epoch(1)
            count = sum(1 for _ in s)
            times.append(time.perf_counter() - t0)
        out[name] = {"seconds": statistics.median(times), "yielded": count}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=10**6, help="samples in the dataset (default 10^6)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.size < 1 or args.repeats < 1 or not 0 <= args.rank < args.world_size:
        p.error("need --size >= 1, --repeats >= 1 and 0 <= --rank < --world-size")
    torch.set_num_threads(1)
    for name, row in bench(args.size, args.world_size, args.rank, repeats=args.repeats).items():
        print(
            f"{PERF_PREFIX} {name:<38} n={args.size} W={args.world_size} rank {args.rank}: "
            f"{row['seconds']:.3f} s, {row['yielded']} items",
            flush=True,
        )


if __name__ == "__main__":
    main()
