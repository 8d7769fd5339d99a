"""PowerSGD counted from shapes: the numbers it sends, and the best error any message of its rank can have.

PowerSGD (Vogels et al., 2019, arXiv 1905.13727; torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py)
views each gradient tensor as a matrix M (n, m) = (shape[0], the rest) and sends P (n x r) and Q (m x r) with
M ~ P Q^T. A rank-r message cannot do better than M's best rank-r approximation, whose error is the singular
values beyond the first r (Eckart-Young): lesson 18 holds the warm-started hook to that bound.
"""

from __future__ import annotations

import torch

__all__ = ["powersgd_numel", "best_rank_error"]


def _compressed(n: int, m: int, rank: int, min_compression_rate: float) -> bool:
    """powerSGD_hook's `_should_compress`: (n + m) r min_compression_rate < n m, r = min(n, m, rank)."""
    r = min(n, m, rank)
    return (n + m) * r * min_compression_rate < n * m


def _matrix_shape(shape) -> tuple[int, int]:
    n = shape[0] if len(shape) else 1
    return n, torch.Size(shape).numel() // n


def powersgd_numel(shapes, rank: int, min_compression_rate: float = 2) -> int:
    """The numbers PowerSGD all-reduces per step for gradients of `shapes`: (n + m) r for each matrix it
    compresses (P and Q), n m for each tensor it sends whole (vectors, small matrices)."""
    total = 0
    for shape in shapes:
        n, m = _matrix_shape(shape)
        compressed = _compressed(n, m, rank, min_compression_rate)
        total += (n + m) * min(n, m, rank) if compressed else n * m
    return total


def best_rank_error(
    flat: torch.Tensor, shapes, rank: int, min_compression_rate: float = 2
) -> float:
    """|M - best rank-`rank` M| / |flat| over the gradient `flat` (the tensors of `shapes` back to back, as in
    a DDP bucket): the singular values beyond the first `rank` of each matrix PowerSGD compresses (the others
    travel exactly), Frobenius norms."""
    dropped, offset = 0.0, 0
    for shape in shapes:
        n, m = _matrix_shape(shape)
        matrix = flat[offset : offset + n * m].view(n, m)
        offset += n * m
        if _compressed(n, m, rank, min_compression_rate):
            dropped += (torch.linalg.svdvals(matrix.double())[rank:] ** 2).sum().item()
    return dropped**0.5 / flat.double().norm().item()
