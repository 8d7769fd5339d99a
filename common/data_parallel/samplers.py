"""Distributed samplers built by hand, with their contracts (lesson 04; the unpadded one in lesson 05).

Every sampler takes (num_replicas, rank) explicitly -- or reads them from the default process group when left
as None -- so a notebook can build rank 1's sampler in one process, as a `DistributedSampler` can.

The contract (property-tested in tests/unit/test_samplers.py with hypothesis):
- `len(sampler)` is what THIS RANK yields in one epoch (samples, or batches for a batch sampler), not the
  dataset's length, and it is the same on every rank, so every rank runs the same number of steps.
  (Exception: `UnpaddedDistributedSampler`, for evaluation, whose shards differ by at most one sample.)
- The order is a pure function of (seed, epoch, rank, num_replicas, input). `set_epoch(e)` changes the
  permutation (call it with the same e on every rank); without it every epoch repeats epoch 0's order.
- Bad input raises `ValueError` with one line: num_replicas < 1, rank outside [0, num_replicas), negative,
  non-finite or all-zero weights, batch_size < 1.

Source: https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler.
The weighted sampler is in `common.data_parallel.weighted_sampler`, length-grouped batches in
`common.data_parallel.bucketing`, per-rank random streams in `common.data_parallel.seeding`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from itertools import product

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, Sampler

__all__ = [
    "check_replicas",
    "pad_or_cut",
    "EpochSampler",
    "distributed_indices",
    "count_matching_configs",
    "DistributedSamplerByHand",
    "UnpaddedDistributedSampler",
]


def check_replicas(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """Resolve (num_replicas, rank): explicit ints, or the default process group's when None.

    Raises:
        ValueError: num_replicas < 1, rank outside [0, num_replicas), or None without a process group.
    """
    if num_replicas is None or rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "num_replicas and rank are needed when no process group is initialized"
            )
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = dist.get_rank() if rank is None else rank
    if int(num_replicas) != num_replicas or num_replicas < 1:
        raise ValueError(
            f"num_replicas (the world size) must be an integer >= 1, got {num_replicas}"
        )
    if int(rank) != rank or not 0 <= rank < num_replicas:
        raise ValueError(
            f"rank must be in [0, {num_replicas}) for num_replicas={num_replicas}, got {rank}"
        )
    return int(num_replicas), int(rank)


def _length(data: int | Sized) -> int:
    n = data if isinstance(data, int) else len(data)
    if n < 0:
        raise ValueError(f"dataset length must be >= 0, got {n}")
    return n


def pad_or_cut(order: torch.Tensor, total_size: int) -> torch.Tensor:
    """Repeat `order` from its start until it has `total_size` entries, or cut it to `total_size`.

    Equals DistributedSampler's `indices += indices[:padding]` (and its `indices * ceil(padding / n)` branch
    when the padding is longer than the list, e.g. 1 sample over 4 ranks).
    """
    if total_size <= len(order):
        return order[:total_size]
    return order.repeat(math.ceil(total_size / len(order)))[:total_size]


def distributed_indices(
    dataset_len: int,
    num_replicas: int,
    rank: int,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
) -> torch.Tensor:
    """The indices `DistributedSampler` gives `rank` in `epoch`, computed by hand (int64 tensor).

    Step by step, exactly as torch.utils.data.DistributedSampler (torch 2.x) does it:
      1. order = torch.randperm(n) from a torch.Generator seeded with seed + epoch (or 0..n-1 without shuffle).
         Every rank computes the SAME permutation: no communication is needed to agree on it.
      2. num_samples = ceil(n / W); the list is padded to W * num_samples by repeating its start
         (drop_last=False), or with drop_last=True num_samples = ceil((n - W) / W) (= n // W) and the tail
         of the permutation is dropped.
      3. rank r takes positions r, r + W, r + 2W, ... (a stride, not a contiguous block).

    Returns:
        int64 tensor of shape (num_samples,).

    Raises:
        ValueError: see `check_replicas`.
    """
    num_replicas, rank = check_replicas(num_replicas, rank)
    n = _length(dataset_len)
    if drop_last and n % num_replicas:
        num_samples = math.ceil(
            (n - num_replicas) / num_replicas
        )  # torch's formula: floor(n / W) here
    else:
        num_samples = math.ceil(n / num_replicas)
    total_size = num_samples * num_replicas
    if n == 0 or total_size == 0:
        return torch.zeros(0, dtype=torch.int64)
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g)
    else:
        order = torch.arange(n)
    return pad_or_cut(order, total_size)[rank:total_size:num_replicas]


def count_matching_configs(seeds=(0, 7), epochs=(0, 1)) -> tuple[int, int]:
    """(matching, total) configurations (n, W, shuffle, drop_last, seed, epoch) on which `distributed_indices`
    equals torch's DistributedSampler on every rank, indices and length (n = 0..12, W = 1..4)."""
    configs = list(product(range(13), range(1, 5), (False, True), (False, True), seeds, epochs))
    match = 0
    for n, w, shuffle, drop_last, seed, epoch in configs:
        ok = True
        for r in range(w):
            ref = DistributedSampler(range(n), w, r, shuffle, seed, drop_last)
            ref.set_epoch(epoch)
            mine = distributed_indices(n, w, r, shuffle, seed, epoch, drop_last).tolist()
            ok &= list(ref) == mine and len(ref) == len(mine)
        match += ok
    return match, len(configs)


class EpochSampler(Sampler):
    """Shared `set_epoch` and (num_replicas, rank) handling."""

    def __init__(self, num_replicas: int | None, rank: int | None, seed: int):
        self.num_replicas, self.rank = check_replicas(num_replicas, rank)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use permutation seed + epoch next time; call it with the same epoch on every rank."""
        self.epoch = int(epoch)

    def _generator(self) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(
            self.seed + self.epoch
        )  # the same on every rank: ranks agree without communicating
        return g


class DistributedSamplerByHand(EpochSampler):
    """A re-implementation of `torch.utils.data.DistributedSampler`: yields exactly its indices.

    Args:
        data: the dataset or its length n.
        num_replicas, rank: the world size and this process's global rank (None: from the process group).
        shuffle, seed, drop_last: as in DistributedSampler.

    len(self) = ceil(n / W) (drop_last=False, with padding repeats) or n // W (drop_last=True): what this rank
    yields, the same on every rank. Raises ValueError on bad (num_replicas, rank).
    """

    def __init__(
        self,
        data: int | Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        super().__init__(num_replicas, rank, seed)
        self.n = _length(data)
        self.shuffle, self.drop_last = shuffle, drop_last

    def indices(self) -> torch.Tensor:
        """This rank's indices for the current epoch, int64 (len(self),)."""
        return distributed_indices(
            self.n,
            self.num_replicas,
            self.rank,
            self.shuffle,
            self.seed,
            self.epoch,
            self.drop_last,
        )

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        if self.drop_last and self.n % self.num_replicas:
            return math.ceil((self.n - self.num_replicas) / self.num_replicas)
        return math.ceil(self.n / self.num_replicas)


class UnpaddedDistributedSampler(EpochSampler):
    """For evaluation: every sample exactly once over all ranks, no padding; shards differ by at most one.

    Rank r takes positions r, r + W, ... of the (optionally shuffled) order: with n = 359 and W = 2, rank 0
    yields 180 samples and rank 1 yields 179; with n = 1, rank 1 yields none. len(self) = ceil((n - rank) / W).
    - Reduce (sum, count) pairs over ranks (`common.harness.ranks.all_reduce_sum`) and divide once.
    - Evaluate the unwrapped module (`raw_model`), not the DDP wrapper: after a training step, DDP's next
      forward broadcasts rank 0's buffers (BatchNorm statistics), a collective every rank must join. A rank
      whose shard is empty (or shorter) never makes that forward, and the others wait in the broadcast until
      the process group's timeout (lesson 05 measures it with 1 sample on 2 ranks).
    - Never train DDP on it: a rank with fewer batches leaves the others waiting in the gradient all-reduce
      (lesson 05: `torch.distributed.algorithms.join.Join`, or agree on a step count).
    """

    def __init__(
        self,
        data: int | Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
    ):
        super().__init__(num_replicas, rank, seed)
        self.n = _length(data)
        self.shuffle = shuffle

    def indices(self) -> torch.Tensor:
        order = (
            torch.randperm(self.n, generator=self._generator())
            if self.shuffle
            else torch.arange(self.n)
        )
        return order[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.num_replicas))
