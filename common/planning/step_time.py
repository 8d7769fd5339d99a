"""The time of a training step, from formulas (lesson 21): the matmul FLOPs it computes, the time of a ring
collective, the alpha-beta fit that measures alpha and beta, and MFU.

Time of a ring collective in the alpha-beta model: steps x alpha + bytes sent x beta (alpha: latency per step,
beta: seconds per byte = 1 / bandwidth)."""

from __future__ import annotations

from collections.abc import Sequence

from common.measure.bandwidth import ring_bytes_sent
from common.planning.cost_model import GPT

__all__ = ["gpt_flops", "residual_mlp_flops", "ring_time", "fit_alpha_beta", "mfu", "forward_flops"]


def gpt_flops(c: GPT, batch: int) -> dict[str, int]:
    """Matmul FLOPs of one training step (forward + backward) on `batch` sequences of `c.seq` tokens.

    Weights: 2 FLOPs per weight per token forward, 4 backward (input and weight gradients): 6 x W x tokens,
    W the matmul weights (12 h^2 per layer + the head's h V; embeddings are lookups, biases and norms are not
    matmuls). Attention: Q K^T and A V, 2 x 2 x b s^2 h per layer forward, x 3 with backward.
    """
    tokens = batch * c.seq
    weights = c.layers * 12 * c.hidden**2 + c.hidden * c.vocab
    out = {
        "weights": 6 * weights * tokens,
        "attention": 12 * batch * c.seq**2 * c.hidden * c.layers,
    }
    out["total"] = out["weights"] + out["attention"]
    return out


def residual_mlp_flops(
    batch: int, width: int, depth: int, in_features: int = 64, classes: int = 10
) -> int:
    """Matmul FLOPs of a forward + backward of lesson 08's ResidualMLP: 6 x weights x samples, less the stem's
    input gradient (2 x 64 w per sample), which backward skips because the data needs no gradient."""
    weights = in_features * width + 2 * depth * width * width + width * classes
    return 6 * weights * batch - 2 * in_features * width * batch


def ring_time(op: str, buffer_bytes: float, n_ranks: int, alpha: float, beta: float) -> float:
    """Alpha-beta time of a ring collective: all-reduce 2 (N-1) steps, all-gather / reduce-scatter N-1."""
    steps = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}[op] * (n_ranks - 1)
    return steps * alpha + ring_bytes_sent(op, buffer_bytes, n_ranks) * beta


def fit_alpha_beta(
    steps: Sequence[float], sent: Sequence[float], seconds: Sequence[float]
) -> tuple[float, float]:
    """Least squares of seconds = alpha x steps + beta x bytes sent, in RELATIVE error (each row divided by its
    time, so that 1 KiB counts as much as 4 MiB); returns (alpha, beta)."""
    rows = [(a / t, b / t) for a, b, t in zip(steps, sent, seconds)]  # target: 1 for every row
    s_aa = sum(a * a for a, _ in rows)
    s_bb = sum(b * b for _, b in rows)
    s_ab = sum(a * b for a, b in rows)
    s_a, s_b = sum(a for a, _ in rows), sum(b for _, b in rows)
    det = s_aa * s_bb - s_ab * s_ab
    if det == 0:
        raise ValueError("fit_alpha_beta needs at least two sizes that differ")
    return (s_a * s_bb - s_b * s_ab) / det, (s_aa * s_b - s_ab * s_a) / det


def mfu(
    model_flops_per_step: float, step_seconds: float, n_devices: int, peak_flops: float
) -> float:
    """Model-FLOPs utilisation: the model's FLOPs per second over what the devices could do at peak."""
    return model_flops_per_step / (step_seconds * n_devices * peak_flops)


def forward_flops(c: GPT, batch: int, tokens: int, start: int = 0) -> int:
    """Matmul FLOPs of one forward of `tokens` new tokens per sequence whose keys start at position `start`
    (a prefill: start 0; a decode step: tokens 1, start = the tokens cached). Weights: 2 FLOPs per weight per
    token, 12 h^2 per layer and the head's h V (logits for every new token). Attention: Q K^T and A V over the
    start + tokens keys, 2 x 2 x tokens x (start + tokens) x h per layer and sequence (the masked part included,
    as matmul attention computes it). Without a cache, step t reruns the whole prefix: tokens = t, start = 0."""
    weights = c.layers * 12 * c.hidden**2 + c.hidden * c.vocab
    attention = 4 * c.layers * tokens * (start + tokens) * c.hidden
    return batch * (2 * weights * tokens + attention)
