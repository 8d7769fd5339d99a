"""Random streams for data loading that differ by rank and reproduce on a rerun (lesson 05).

Augmentations draw random numbers in one of two places, and each needs its own per-rank seed:
- in DataLoader workers (num_workers=k > 0): a DataLoader draws one `base_seed` from its `generator=` (from
  torch's global RNG when none is given) each time an iterator is created, and worker w seeds torch and
  `random` with base_seed + w and numpy with a hash of (base_seed, w)
  (torch.utils.data._utils.worker._worker_loop). So the workers of one rank already differ; but ranks that
  seeded the global RNG alike draw the same base_seed, and worker w on rank 0 repeats worker w on rank 1.
- in the main process (num_workers=0, the default): straight from the global torch, numpy and `random` RNGs,
  which the common `set_seed(seed)` (the same on every rank, as the model's initialisation needs) makes
  identical on every rank. A DataLoader generator does not reach these draws at all.

`seed_data_rngs(seed, rank)`, called after the model is built, covers both: it re-seeds the global RNGs with
`rank_seed(seed, rank)` and returns `loader_generator(seed, rank)` for the DataLoader. The probes at the end
(`RandomAugmentStream`, `augmentation_streams`, `stream_summary`, `generator_draws`) measure it.

When the base seed is drawn: every `for x in loader` (every epoch) creates an iterator and draws a new one,
EXCEPT with `persistent_workers=True`, where the iterator and its workers are created once, at the first epoch:
later epochs continue the workers' streams and draw nothing from the generator, so re-seeding the generator
between epochs changes nothing (lesson 05 counts the draws).
See https://pytorch.org/docs/stable/data.html#randomness-in-multi-process-data-loading.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from common.harness.session import set_seed

__all__ = [
    "rank_seed",
    "loader_generator",
    "seed_data_rngs",
    "RandomAugmentStream",
    "augmentation_streams",
    "generator_draws",
    "stream_summary",
    "distinct_streams",
    "describe_pairs",
    "seeding_demo",
]


def rank_seed(seed: int, rank: int) -> int:
    """A 63-bit seed for (seed, rank), different for every rank, reproducible from the two integers.

    Derived with numpy's SeedSequence (hashing, not seed + rank, so (seed=1, rank=0) and (seed=0, rank=1)
    do not collide). Raises ValueError for a negative seed or rank.
    """
    if seed < 0 or rank < 0:
        raise ValueError(f"seed and rank must be >= 0, got seed={seed}, rank={rank}")
    return int(
        np.random.SeedSequence([int(seed), int(rank)]).generate_state(1, dtype=np.uint64)[0] >> 1
    )


def loader_generator(seed: int, rank: int) -> torch.Generator:
    """The `generator=` to give a DataLoader on `rank`: base seeds, hence worker streams, differ by rank.

    It reaches DataLoader WORKERS only; with num_workers=0 use `seed_data_rngs`, which also re-seeds the
    global RNGs the main process draws from.
    """
    return torch.Generator().manual_seed(rank_seed(seed, rank))


def seed_data_rngs(seed: int, rank: int) -> torch.Generator:
    """Per-rank data randomness for 0 or k workers; call it AFTER building the model with `set_seed(seed)`.

    Re-seeds torch (CPU and CUDA), numpy and `random` with rank_seed(seed, rank) -- what augmentations in the
    main process draw from -- and returns loader_generator(seed, rank) for `DataLoader(generator=...)`, which
    seeds the workers. The model's initialisation (same on every rank) is already done by then; DDP would also
    copy rank 0's parameters to every rank when it wraps the model.
    """
    s = rank_seed(seed, rank)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    return loader_generator(seed, rank)


# The probes: what lesson 05, its notebook and the unit tests measure the seeding with. ----------------------------
class RandomAugmentStream(Dataset):
    """Each item records the random draws an augmentation would make: one from torch, numpy and `random`."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = get_worker_info()
        return (
            info.id if info else -1,
            torch.rand(()).item(),
            float(np.random.rand()),
            random.random(),
        )


def augmentation_streams(
    n: int, workers: int, generator, epochs: int = 1, persistent: bool = False
) -> dict:
    """{worker id (-1: main process): [[torch, numpy, random] draws, 9 decimals], in the order it drew them}."""
    loader = DataLoader(
        RandomAugmentStream(n),
        batch_size=1,
        num_workers=workers,
        generator=generator,
        persistent_workers=persistent,
        collate_fn=lambda batch: batch[0],
    )
    streams: dict[int, list] = {}
    for _ in range(epochs):
        for wid, *draws in loader:
            streams.setdefault(wid, []).append([round(d, 9) for d in draws])
    return streams


def generator_draws(generator, seed: int, rank: int) -> int:
    """How many int64 draws separate `generator` from a fresh loader_generator(seed, rank)."""
    fresh = loader_generator(seed, rank)
    for k in range(8):
        if torch.equal(fresh.get_state(), generator.get_state()):
            return k
        torch.empty((), dtype=torch.int64).random_(generator=fresh)
    return -1


def stream_summary(per_rank: list[dict]) -> dict:
    """Distinctness of the (rank, worker) streams of one configuration, together and per library."""
    streams = {f"r{r}w{w}": s for r, d in enumerate(per_rank) for w, s in sorted(d.items())}
    names = sorted(streams)
    identical = [
        f"{a}={b}" for i, a in enumerate(names) for b in names[i + 1 :] if streams[a] == streams[b]
    ]
    libs = {
        lib: len({tuple(d[j] for d in v) for v in streams.values()})
        for j, lib in enumerate(("torch", "numpy", "random"))
    }
    return {
        "streams": streams,
        "num_streams": len(names),
        "num_distinct": len({str(v) for v in streams.values()}),
        "identical_pairs": identical,
        "distinct_per_library": libs,
    }


def distinct_streams(summary: dict) -> list[int]:
    """The numbers of distinct torch, numpy and random streams of a `stream_summary`."""
    return list(summary["distinct_per_library"].values())


def describe_pairs(summary: dict) -> str:
    """A `stream_summary`'s identical pairs in words: "r0w-1=r1w-1" -> "rank 0 main process = rank 1 main
    process" (worker id -1 is the main process, the only one with 0 workers), "r0w1=r1w1" -> "rank 0 worker 1
    = rank 1 worker 1"."""

    def name(key: str) -> str:
        rank, worker = key[1:].split("w")
        return f"rank {rank} " + ("main process" if worker == "-1" else f"worker {worker}")

    pairs = [" = ".join(name(k) for k in pair.split("=")) for pair in summary["identical_pairs"]]
    return "; ".join(pairs) or "none"


def seeding_demo(
    seed: int, rank: int, n: int, k: int, gather: Callable[[dict], list[dict]]
) -> dict:
    """Lesson 05's seeding section, measured: each configuration's streams of `n` samples on every rank,
    gathered by `gather` (obj -> [obj of each rank]) into a `stream_summary`; each starts from set_seed(seed),
    as a lesson does (the model built from one seed on every rank).

    Returns {"rank_seed": {0: [run, rerun], k: [run, rerun]}: the fix, seed_data_rngs(seed, rank), with 0 and
    k workers; "same_seed": the mistake, k workers and no generator; "generator_only": 0 workers and
    loader_generator(seed, rank) alone; "base_seeds": {False: draws, True: draws}, what the generator gave in
    2 epochs without and with persistent_workers}."""
    out = {"rank_seed": {}, "base_seeds": {}}
    for workers in (0, k):
        runs = []
        for _ in range(2):  # a run and its rerun
            set_seed(seed)
            streams = augmentation_streams(n, workers, seed_data_rngs(seed, rank))
            runs.append(stream_summary(gather(streams)))
        out["rank_seed"][workers] = runs
    set_seed(seed)
    out["same_seed"] = stream_summary(gather(augmentation_streams(n, k, None)))
    set_seed(seed)
    streams = augmentation_streams(n, 0, loader_generator(seed, rank))
    out["generator_only"] = stream_summary(gather(streams))
    for persistent in (False, True):
        g = loader_generator(seed, rank)
        augmentation_streams(n, k, g, epochs=2, persistent=persistent)
        out["base_seeds"][persistent] = generator_draws(g, seed, rank)
    return out
