"""Distributed samplers built by hand, with their contracts (introduced in lesson 04).

Every sampler here takes (num_replicas, rank) explicitly -- or reads them from the default process group when
left as None -- so a notebook can build rank 1's sampler in a single process, as a `DistributedSampler` can.

The contract all of them keep (what lesson 04 tests with hypothesis):
- `len(sampler)` is what THIS RANK yields in one epoch (samples, or batches for a batch sampler), not the
  dataset's length; it is the same number on every rank, so every rank runs the same number of steps and no
  rank waits forever in DDP's gradient all-reduce. (The one exception is `UnpaddedDistributedSampler`, built
  for evaluation, whose shards differ by at most one sample; reduce (sum, count) pairs after it.)
- The order is a pure function of (seed, epoch, rank, num_replicas, input): the same arguments give the same
  order in every process and on every rerun. `set_epoch(e)` changes the permutation (all ranks must call it
  with the same e, like `DistributedSampler.set_epoch`); without it every epoch repeats epoch 0's order.
- Bad input raises `ValueError` with one line: num_replicas < 1, rank outside [0, num_replicas), negative,
  non-finite or all-zero weights, batch_size < 1.

See https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler for the sampler
these follow, and https://pytorch.org/docs/stable/data.html#randomness-in-multi-process-data-loading for how a
DataLoader seeds its workers (`loader_generator` below).
"""
from __future__ import annotations

import math
from typing import Iterator, Sequence, Sized

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["check_replicas", "distributed_indices", "DistributedSamplerByHand", "UnpaddedDistributedSampler",
           "WeightedDistributedSampler", "LengthGroupedDistributedBatchSampler", "padded_tokens",
           "padded_token_fraction", "rank_seed", "loader_generator"]


def check_replicas(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """Resolve (num_replicas, rank): explicit ints, or the default process group's when None.

    Raises:
        ValueError: num_replicas < 1, rank outside [0, num_replicas), or None without a process group.
    """
    if num_replicas is None or rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("num_replicas and rank are needed when no process group is initialized")
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = dist.get_rank() if rank is None else rank
    if int(num_replicas) != num_replicas or num_replicas < 1:
        raise ValueError(f"num_replicas (the world size) must be an integer >= 1, got {num_replicas}")
    if int(rank) != rank or not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, {num_replicas}) for num_replicas={num_replicas}, got {rank}")
    return int(num_replicas), int(rank)


def _length(data: int | Sized) -> int:
    n = data if isinstance(data, int) else len(data)
    if n < 0:
        raise ValueError(f"dataset length must be >= 0, got {n}")
    return n


def _pad_or_cut(order: torch.Tensor, total_size: int) -> torch.Tensor:
    """Repeat `order` from its start until it has `total_size` entries, or cut it to `total_size`.

    Equals DistributedSampler's `indices += indices[:padding]` (and its `indices * ceil(padding / n)` branch
    when the padding is longer than the list, e.g. 1 sample over 4 ranks).
    """
    if total_size <= len(order):
        return order[:total_size]
    return order.repeat(math.ceil(total_size / len(order)))[:total_size]


def distributed_indices(dataset_len: int, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0,
                        epoch: int = 0, drop_last: bool = False) -> torch.Tensor:
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
        num_samples = math.ceil((n - num_replicas) / num_replicas)  # torch's formula: floor(n / W) here
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
    return _pad_or_cut(order, total_size)[rank:total_size:num_replicas]


class _EpochSampler(Sampler):
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
        g.manual_seed(self.seed + self.epoch)  # the same on every rank: ranks agree without communicating
        return g


class DistributedSamplerByHand(_EpochSampler):
    """A re-implementation of `torch.utils.data.DistributedSampler`: yields exactly its indices.

    Args:
        data: the dataset or its length n.
        num_replicas, rank: the world size and this process's global rank (None: from the process group).
        shuffle, seed, drop_last: as in DistributedSampler.

    len(self) = ceil(n / W) (drop_last=False, with padding repeats) or n // W (drop_last=True): what this rank
    yields, the same on every rank. Raises ValueError on bad (num_replicas, rank).
    """

    def __init__(self, data: int | Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        super().__init__(num_replicas, rank, seed)
        self.n = _length(data)
        self.shuffle, self.drop_last = shuffle, drop_last

    def indices(self) -> torch.Tensor:
        """This rank's indices for the current epoch, int64 (len(self),)."""
        return distributed_indices(self.n, self.num_replicas, self.rank, self.shuffle, self.seed, self.epoch,
                                   self.drop_last)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        if self.drop_last and self.n % self.num_replicas:
            return math.ceil((self.n - self.num_replicas) / self.num_replicas)
        return math.ceil(self.n / self.num_replicas)


class UnpaddedDistributedSampler(_EpochSampler):
    """For evaluation: every sample exactly once over all ranks, no padding; shards differ by at most one.

    Rank r takes positions r, r + W, ... of the (optionally shuffled) order, stopping at n: with n = 359 and
    W = 2, rank 0 yields 180 samples and rank 1 yields 179. Because shard sizes differ, reduce (sum, count)
    pairs over ranks (`common.ranks.all_reduce_sum`) and divide once -- never average per-rank means --
    and never use it for DDP training, where a rank with fewer batches leaves the others waiting in an
    all-reduce (use `torch.distributed.algorithms.join.Join` if you must train on uneven shards).

    len(self) = len(range(rank, n, W)) = ceil((n - rank) / W).
    """

    def __init__(self, data: int | Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = False, seed: int = 0):
        super().__init__(num_replicas, rank, seed)
        self.n = _length(data)
        self.shuffle = shuffle

    def indices(self) -> torch.Tensor:
        order = torch.randperm(self.n, generator=self._generator()) if self.shuffle else torch.arange(self.n)
        return order[self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.num_replicas))


class WeightedDistributedSampler(_EpochSampler):
    """Weighted random sampling split over ranks: sample i is drawn with probability weights[i] / sum(weights).

    One global draw of W * ceil(num_samples / W) indices comes from a generator seeded with seed + epoch --
    exactly `list(WeightedRandomSampler(weights, W * ceil(num_samples / W), replacement, generator=g))` --
    and rank r takes positions r, r + W, .... So each rank's stream is deterministic from (seed, epoch),
    different from every other rank's (different positions of one draw), and the union over ranks is the same
    draw a single process would make, whatever the world size. Each rank draws the whole global list
    (10^6 weights: about 0.2 s on one CPU core) so that no communication is needed.

    Args:
        weights: (n,) non-negative, finite, not all zero; e.g. 1 / count(class of sample i) to balance classes.
            Every rank must pass the same weights (compute them from data every rank holds).
        num_samples: draws per epoch over ALL ranks (default n); each rank yields ceil(num_samples / W).
        replacement: with replacement (the usual choice for rebalancing); without, num_samples must not exceed
            the number of positive weights and the list is padded by repeating its start, like DistributedSampler.

    Raises:
        ValueError: bad (num_replicas, rank), weights not 1-D, negative, non-finite or all zero, num_samples < 1,
            or more draws without replacement than positive weights.
    """

    def __init__(self, weights: Sequence[float] | torch.Tensor, num_replicas: int | None = None,
                 rank: int | None = None, num_samples: int | None = None, replacement: bool = True, seed: int = 0):
        super().__init__(num_replicas, rank, seed)
        w = torch.as_tensor(weights, dtype=torch.double)  # the dtype WeightedRandomSampler uses
        if w.dim() != 1 or len(w) == 0:
            raise ValueError(f"weights must be a non-empty 1-D sequence, got shape {tuple(w.shape)}")
        if not torch.isfinite(w).all():
            raise ValueError("weights must be finite (found inf or nan)")
        if (w < 0).any():
            raise ValueError(f"weights must be >= 0, found {w.min().item():g} at index {int(w.argmin())}")
        if w.sum() <= 0:
            raise ValueError("weights are all zero: there is nothing to sample")
        self.weights = w
        self.num_total = len(w) if num_samples is None else int(num_samples)
        if self.num_total < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.replacement = replacement
        if not replacement and self.num_total > int((w > 0).sum()):
            raise ValueError(f"cannot draw {self.num_total} samples without replacement from "
                             f"{int((w > 0).sum())} positive weights")
        self.num_samples = math.ceil(self.num_total / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def global_draw(self) -> torch.Tensor:
        """The whole epoch's draw over all ranks, int64 (total_size,); rank r's share is [r::W]."""
        g = self._generator()
        if self.replacement:
            return torch.multinomial(self.weights, self.total_size, True, generator=g)
        drawn = torch.multinomial(self.weights, self.num_total, False, generator=g)
        return _pad_or_cut(drawn, self.total_size)

    def indices(self) -> torch.Tensor:
        return self.global_draw()[self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples


class LengthGroupedDistributedBatchSampler(_EpochSampler):
    """Batches of similar-length sequences, shuffled per epoch, the same number of batches on every rank.

    Per epoch (generator seeded with seed + epoch, identical on every rank):
      1. shuffle all n indices;
      2. cut the shuffled list into pools of batch_size * pool_batches and sort each pool by length,
         longest first, so neighbours have similar lengths (a pool, not the whole dataset, keeps batches random);
      3. cut into batches of batch_size (only the very last batch can be smaller), ceil(n / batch_size) batches;
      4. shuffle the batch order, pad it by repeating batches from its start to a multiple of W (or drop the tail
         with drop_last), and give rank r batches r, r + W, ....

    len(self) = ceil(ceil(n / batch_size) / W) batches (drop_last: floor), identical on every rank. Use it as
    `DataLoader(ds, batch_sampler=sampler, collate_fn=pad_collate)`.

    Args:
        lengths: (n,) sequence lengths (tokens), non-negative integers.
        batch_size: sequences per batch per rank (>= 1).
        pool_batches: batches per sorting pool (>= 1); larger pools group lengths more tightly.

    Raises:
        ValueError: bad (num_replicas, rank), batch_size < 1, pool_batches < 1, lengths not 1-D or negative.
    """

    def __init__(self, lengths: Sequence[int] | torch.Tensor, batch_size: int, num_replicas: int | None = None,
                 rank: int | None = None, seed: int = 0, pool_batches: int = 50, drop_last: bool = False):
        super().__init__(num_replicas, rank, seed)
        if int(batch_size) != batch_size or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size}")
        if int(pool_batches) != pool_batches or pool_batches < 1:
            raise ValueError(f"pool_batches must be an integer >= 1, got {pool_batches}")
        lens = torch.as_tensor(lengths, dtype=torch.int64)
        if lens.dim() != 1:
            raise ValueError(f"lengths must be 1-D, got shape {tuple(lens.shape)}")
        if len(lens) and lens.min() < 0:
            raise ValueError(f"lengths must be >= 0, found {lens.min().item()}")
        self.lengths, self.batch_size, self.pool_batches = lens, int(batch_size), int(pool_batches)
        self.drop_last = drop_last
        self.num_batches_total = math.ceil(len(lens) / self.batch_size)

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_batches_total // self.num_replicas
        return math.ceil(self.num_batches_total / self.num_replicas)

    def grouped_order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sorted_indices (n,), batch_ids (len(self),)): batch b is sorted_indices[b*B : (b+1)*B]."""
        n, b = len(self.lengths), self.batch_size
        if n == 0 or len(self) == 0:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
        g = self._generator()
        perm = torch.randperm(n, generator=g)
        # Pools hold P = batch_size * pool_batches positions, a multiple of batch_size, so no batch straddles two
        # pools. View the shuffled lengths as (num_pools, P), the last pool filled up with -1, and sort each row,
        # longest first: the -1 fillers sort to the very end and are cut off.
        pool = b * self.pool_batches
        num_pools = math.ceil(n / pool)
        lens = torch.full((num_pools * pool,), -1, dtype=torch.int64)
        lens[:n] = self.lengths[perm]
        within = torch.sort(lens.view(num_pools, pool), dim=1, descending=True, stable=True).indices
        positions = (within + pool * torch.arange(num_pools).unsqueeze(1)).flatten()[:n]
        sorted_indices = perm[positions]
        batch_order = torch.randperm(self.num_batches_total, generator=g)
        total = len(self) * self.num_replicas
        return sorted_indices, _pad_or_cut(batch_order, total)[self.rank:total:self.num_replicas]

    def __iter__(self) -> Iterator[list[int]]:
        sorted_indices, batch_ids = self.grouped_order()
        if len(batch_ids) == 0:
            return
        # (num_batches_total, B) table, the one short last batch filled with -1; then this rank's rows only, so a
        # rank converts n / W indices to Python ints, not n.
        b = self.batch_size
        table = torch.full((self.num_batches_total * b,), -1, dtype=torch.int64)
        table[:len(sorted_indices)] = sorted_indices
        rows = table.view(-1, b)[batch_ids].tolist()
        short = len(sorted_indices) % b  # > 0: batch num_batches_total - 1 holds only `short` samples
        for i, row in zip(batch_ids.tolist(), rows):
            yield row[:short] if short and i == self.num_batches_total - 1 else row


def padded_tokens(batches: Sequence[Sequence[int]], lengths: Sequence[int] | torch.Tensor) -> tuple[int, int]:
    """(real tokens, tokens in the padded tensors) over these batches; each batch pads to (B, its max length).

    For one batch of lengths [3, 5, 8] the padded tensor is 3 x 8 = 24 tokens of which 16 are real.
    Sum these pairs over ranks before dividing (see `padded_token_fraction`).
    """
    lens = torch.as_tensor(lengths, dtype=torch.int64)
    real = padded = 0
    for batch in batches:
        bl = lens[torch.as_tensor(list(batch), dtype=torch.int64)]
        if len(bl):
            real += int(bl.sum())
            padded += len(bl) * int(bl.max())
    return real, padded


def padded_token_fraction(batches: Sequence[Sequence[int]], lengths: Sequence[int] | torch.Tensor) -> float:
    """Fraction of padding tokens, 1 - real / padded (1/3 for the batch [3, 5, 8]); 0.0 when there are none."""
    real, padded = padded_tokens(batches, lengths)
    return 1.0 - real / padded if padded else 0.0


def rank_seed(seed: int, rank: int) -> int:
    """A 63-bit seed for (seed, rank), different for every rank, reproducible from the two integers.

    Derived with numpy's SeedSequence (hashing, not seed + rank, so (seed=1, rank=0) and (seed=0, rank=1)
    do not collide). Raises ValueError for a negative seed or rank.
    """
    if seed < 0 or rank < 0:
        raise ValueError(f"seed and rank must be >= 0, got seed={seed}, rank={rank}")
    return int(np.random.SeedSequence([int(seed), int(rank)]).generate_state(1, dtype=np.uint64)[0] >> 1)


def loader_generator(seed: int, rank: int) -> torch.Generator:
    """The `generator=` to give a DataLoader on `rank` so that every (rank, worker) has its own random streams.

    A DataLoader draws one `base_seed` from its generator (or from torch's global RNG when none is given) each
    time it is iterated, and worker w seeds torch and `random` with base_seed + w and numpy with a hash of
    (base_seed, w) (torch.utils.data._utils.worker._worker_loop). So workers of one rank already differ; but
    when every rank seeds the global RNG with the same number, every rank draws the same base_seed and worker w
    on rank 0 repeats worker w on rank 1's augmentations. Seeding this generator with rank_seed(seed, rank)
    makes the base seeds differ by rank, and the same seed reproduces them on a rerun.
    """
    return torch.Generator().manual_seed(rank_seed(seed, rank))
