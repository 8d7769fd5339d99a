"""How far apart two results are, NaN-safe: a NaN or an inf anywhere makes the difference NaN or inf, never 0.

An equality claim ("split equals unsplit: max |difference| <= 1e-5") is only worth something if a broken run
fails it. Three everyday ways to compute "the largest difference" swallow a NaN, and each hid a diverged run here:

- Python's `max(worst, d)` keeps `worst` when `d` is NaN (every comparison with NaN is False), so the NaN is
  lost unless it happens to come first: `max(0.0, nan) == 0.0` but `max(nan, 0.0)` is nan.
- `dist.all_reduce(t, op=MAX)` on gloo does the same across ranks: rank 0's 0.0 and rank 1's NaN reduce to 0.0
  (measured here with torch 2.13).
- A tolerance test `d <= tol` is False for NaN, but `not d > tol` is True: write the bound the first way.

`torch.max` / `Tensor.amax` do propagate NaN within one tensor. So: reduce each pair of tensors with torch, fold
the numbers with `nan_max`, and cross ranks with `max_over_ranks`. `common.harness.results.holds` is False for NaN and
inf against a "<=" bound, so the claim fails and the lesson exits non-zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "nan_max",
    "max_abs_diff",
    "max_abs_diff_all",
    "max_over_ranks",
    "relative_difference",
    "norm_error",
]


def nan_max(values: Iterable[float], default: float = 0.0) -> float:
    """The largest of `values`; NaN when any is NaN and inf when any is +-inf, wherever it is (a difference is
    never -inf: one that is came from a broken computation); `default` when there are none."""
    worst = None
    for v in values:
        v = float(v)
        if math.isnan(v):
            return math.nan
        v = abs(v) if math.isinf(v) else v
        worst = v if worst is None else max(worst, v)
    return default if worst is None else worst


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over same-shaped tensors (in their own dtypes); NaN or inf if either holds one anywhere.

    A non-finite element of `a` or `b` gives a non-finite difference (inf - inf and NaN - x are NaN, inf - x is
    inf), and `Tensor.max` propagates NaN, so no element can hide one. 0.0 for empty tensors.
    """
    if a.numel() == 0:
        return 0.0
    return (a.detach() - b.detach().to(a.device)).abs().max().item()


def max_abs_diff_all(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> float:
    """`max_abs_diff` over pairs of tensors (parameters, gradients), folded by `nan_max`; 16-bit tensors are
    compared in float32 (a bf16 difference would round the difference itself)."""
    return nan_max(max_abs_diff(_at_least_fp32(u), _at_least_fp32(v)) for u, v in zip(a, b))


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() and t.element_size() < 4 else t


def max_over_ranks(value: float, group=None) -> float:
    """The largest `value` over the ranks of `group` (the world by default), NaN if any rank's is NaN;
    `value` itself without a process group (-inf counts as inf, as in `nan_max`). A collective: every rank of
    `group` calls it.

    gloo's MAX drops a NaN that is not on the first rank, so a NaN travels as +inf beside a flag that says so.
    """
    value = nan_max([value])
    if not dist.is_initialized():
        return value
    on_gpu = dist.get_backend(group) == "nccl"  # NCCL reduces CUDA tensors only
    is_nan = math.isnan(value)
    t = torch.tensor(
        [math.inf if is_nan else value, float(is_nan)],
        dtype=torch.float64,
        device="cuda" if on_gpu else "cpu",
    )
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return math.nan if t[1].item() > 0 else t[0].item()


def relative_difference(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], start: Sequence[torch.Tensor]
) -> float:
    """||a - b|| / ||b - start||, L2 over all elements: how far apart two runs ended, as a fraction of how far
    training moved the parameters from `start`. NaN or inf anywhere makes it NaN or inf (a claim fails).

    Why not max |a - b|: Adam turns a gradient that is pure float32 noise (a sum that cancels) into a full step
    of either sign, so single elements of two correct runs can differ by up to ~lr per step (lesson 13 saw 0.26
    lr x steps at N = 8). Over all elements the real updates dominate: lesson 13's correct runs stayed at 0 to
    4.3e-6 of the movement (N = 2, 4, 8; 5 steps at lr 1e-3 and 50 at 1e-2), while an error in the algorithm
    (a wrong slice, a stale shard) is of the order of the movement itself.
    """

    def flat(ts):
        return torch.cat([t.detach().float().reshape(-1).cpu() for t in ts])

    a, b, start = flat(a), flat(b), flat(start)
    apart, moved = (a - b).norm().item(), (b - start).norm().item()
    if moved == 0.0:  # nothing moved (a tiny lr): equal or not at all
        return 0.0 if apart == 0.0 else math.inf
    return apart / moved


def norm_error(g: torch.Tensor, reference: torch.Tensor) -> float:
    """|g - reference| / |reference| (Frobenius norms, as in the SVD bound of a best rank-r approximation), the
    worst over ranks: how far a compressed gradient is from the one it stands for. NaN anywhere gives NaN."""
    return max_over_ranks(((g - reference).norm() / reference.norm()).item())
