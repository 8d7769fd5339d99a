"""Grader of exercises/distributed_sampler.py: the same indices as torch's DistributedSampler, graded in one
process."""
from __future__ import annotations

import importlib
import itertools

from torch.utils.data import DistributedSampler

WORLD_SIZE = 0
FUNCTIONS = ["MyDistributedSampler"]
CASES = list(itertools.product((10, 7, 2, 1, 0), (1, 2, 3, 4), (True, False), (False, True), (0, 3)))


def _hint(n: int, replicas: int, drop_last: bool, got: list[int], want: list[int]) -> str:
    if len(got) != len(want):
        if not drop_last and len(got) < len(want):
            return (f"pad the order so that {n} samples become {len(want) * replicas} "
                    f"(every rank gets {len(want)})")
        return f"every rank must yield {len(want)} indices"
    if sorted(got) == sorted(want):
        return "the right indices in another order: shuffle with a generator seeded with seed + epoch"
    return "rank r takes order[r::num_replicas] of the epoch's (padded) order"


def check(module: str) -> list[str]:
    sampler_class = importlib.import_module(module).MyDistributedSampler
    for n, replicas, shuffle, drop_last, epoch in CASES:
        if n == 0 and not drop_last:
            continue  # torch's sampler cannot pad an empty dataset
        for rank in range(replicas):
            mine = sampler_class(n, replicas, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
            theirs = DistributedSampler(range(n), replicas, rank, shuffle=shuffle, seed=5,
                                        drop_last=drop_last)
            mine.set_epoch(epoch)
            theirs.set_epoch(epoch)
            got, want = list(mine), list(theirs)
            case = (f"dataset_len={n}, num_replicas={replicas}, rank={rank}, shuffle={shuffle}, "
                    f"drop_last={drop_last}, epoch {epoch}")
            if got != want:
                return [f"{case}: yours {got}, DistributedSampler's {want}: "
                        f"{_hint(n, replicas, drop_last, got, want)}"]
            if len(mine) != len(want):
                return [f"{case}: len(sampler) is {len(mine)} but it yields {len(want)}: len is what "
                        f"THIS rank "
                        f"yields (DataLoader sizes its epoch from it)"]
    return []
