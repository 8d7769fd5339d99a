"""How Accelerate's prepared DataLoader deals batches to ranks (23), counted from the batches a rank reads.

`accelerator.prepare(loader)` keeps the loader's own BatchSampler and wraps it in a BatchSamplerShard
(accelerate/data_loader.py, `_iter_with_no_split`): every rank walks the same sequence of batches and
rank r keeps batches r, r + W, r + 2W, ... A DistributedSampler deals samples instead: rank r takes
samples r, r + W, ... of the order, so rank 0's first batch would be samples 0, W, 2W, ...
"""

from __future__ import annotations

__all__ = ["dealt_in_turn"]


def dealt_in_turn(batches: list[list[int]], rank: int, world_size: int, n: int) -> tuple[int, int]:
    """(batches off the rule, batches checked) for one pass of an UNSHUFFLED loader of n samples,
    `batches` holding the sample indices of each batch this rank read. The rule: this rank's batch i
    is batch i W + r of the loader, samples (i W + r) B ... (i W + r + 1) B - 1 with B the batch size.
    The tail, which the shard fills from the first batches so that every rank steps alike, is not
    checked."""
    if not batches:
        return 0, 0
    size = len(batches[0])
    checked = off = 0
    for i, got in enumerate(batches):
        start = (i * world_size + rank) * size
        if start + size > n:  # the tail: completed with samples from the start
            break
        checked += 1
        off += got != list(range(start, start + size))
    return off, checked
