"""Grader of exercises/distributed_sampler.py: the same indices as torch's DistributedSampler, graded in one
process; each sampler is iterated once before set_epoch (the order must follow the epoch), and torch's global
random state must not change."""

from __future__ import annotations

import importlib
import itertools

import torch
from torch.utils.data import DistributedSampler

WORLD_SIZE = 0
FUNCTIONS = ["MyDistributedSampler"]
CASES = list(
    itertools.product((10, 7, 2, 1, 0), (1, 2, 3, 4), (True, False), (False, True), (0, 3))
)


def _hint(n: int, replicas: int, drop_last: bool, got: list[int], want: list[int]) -> str:
    if len(got) != len(want):
        if not drop_last and len(got) < len(want):
            return (
                f"pad the order so that {n} samples become {len(want) * replicas} "
                f"(every rank gets {len(want)})"
            )
        return f"every rank must yield {len(want)} indices"
    if sorted(got) == sorted(want):
        return (
            "the right indices in another order: shuffle with a generator seeded with seed + epoch"
        )
    return "rank r takes order[r::num_replicas] of the epoch's (padded) order"


def check(module: str) -> list[str]:
    sampler_class = importlib.import_module(module).MyDistributedSampler
    for n, replicas, shuffle, drop_last, epoch in CASES:
        if n == 0 and not drop_last:
            continue  # torch's sampler cannot pad an empty dataset
        for rank in range(replicas):
            mine = sampler_class(n, replicas, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
            theirs = DistributedSampler(
                range(n), replicas, rank, shuffle=shuffle, seed=5, drop_last=drop_last
            )
            rng = torch.get_rng_state()
            before = list(
                mine
            )  # an epoch at the default epoch first: set_epoch must still change the order
            mine.set_epoch(epoch)
            theirs.set_epoch(epoch)
            got, want = list(mine), list(theirs)
            case = (
                f"dataset_len={n}, num_replicas={replicas}, rank={rank}, shuffle={shuffle}, "
                f"drop_last={drop_last}, epoch {epoch}"
            )
            if got != want and shuffle and epoch != 0 and got == before:
                return [
                    f"{case}: after set_epoch({epoch}) yours still yields the order of the epoch "
                    f"before, {got}; DistributedSampler's {want}: compute the order in __iter__, every "
                    f"time, from seed + the current epoch"
                ]
            if got != want:
                return [
                    f"{case}: yours {got}, DistributedSampler's {want}: "
                    f"{_hint(n, replicas, drop_last, got, want)}"
                ]
            if len(mine) != len(want):
                return [
                    f"{case}: len(sampler) is {len(mine)} but it yields {len(want)}: len is what "
                    f"THIS rank "
                    f"yields (DataLoader sizes its epoch from it)"
                ]
            if not torch.equal(torch.get_rng_state(), rng):
                return [
                    f"{case}: iterating your sampler changed torch's global random state: draw the "
                    f"permutation from your own torch.Generator seeded with seed + epoch (reseeding or "
                    f"drawing from the global one changes every other random draw: dropout, "
                    f"augmentation)"
                ]
    return []
