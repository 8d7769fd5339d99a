"""The planner of lesson 21: which (dp, tp, pp, cp, ZeRO stage, checkpointing) fits a GPT-style model on G GPUs,
with its memory per rank, bytes sent per step and an estimated step time and MFU. Formulas only
(common/planning/cost_model.py and step_time.py, checked against measurement by lesson 21); no model is built,
nothing is allocated.

    rows = plan(GPT(80, 8192, 64, 32000, 4096), Assumptions(gpus=64, gpu_memory_gb=80))

The command line around it (lesson 21's --params / --model flags and the printed table) is
common/planning/cli.py.

The machine and the model it assumes, and the printed assumptions: common/planning/assumptions.py.
"""

from __future__ import annotations

import math

from common.planning.assumptions import Assumptions, PlanError
from common.planning.cost_model import (
    GPT,
    in_flight_micro_batches,
    tp_layer_params,
    transformer_layer_activations,
    zero_mixed_bytes,
)
from common.planning.step_time import gpt_flops, mfu, ring_time

__all__ = [
    "rank_params",
    "plan",
    "evaluate_layout",
]


def rank_params(c: GPT, tp: int, pp: int) -> float:
    """Parameters on the busiest rank: its L / pp layers (Linears split by tp, 6 h replicated per layer) plus the
    embeddings (first stage) or the head and final norm (last stage), whichever stage is larger."""
    h = c.hidden
    layers = (
        c.layers / pp * tp_layer_params(h, tp)
    )  # checked against lesson 10's split model by lesson 21
    first, last = c.vocab * h / tp + c.seq * h, (h * c.vocab + c.vocab) / tp + 2 * h
    return layers + (first + last if pp == 1 else max(first, last))


def _check(c: GPT, a: Assumptions) -> None:
    numbers = {
        "--gpus": a.gpus,
        "--gpu-memory-gb": a.gpu_memory_gb,
        "--global-batch": a.global_batch,
        "--micro-batch": a.micro_batch,
        "--peak-tflops": a.peak_tflops,
        "--network-gbps": a.network_gbps,
        "--nvlink-gbps": a.nvlink_gbps,
        "--efficiency": a.efficiency,
        "--gpus-per-node": a.gpus_per_node,
    }
    bad = [k for k, v in numbers.items() if not v > 0 or math.isinf(v)]
    if (
        bad or not 0 <= a.alpha_us < math.inf or not 0 <= a.reserve < 1 or a.efficiency > 1
    ):  # NaN fails too
        raise PlanError(
            f"sizes must be positive and finite ({', '.join(bad) or '--alpha-us, --reserve'}), "
            "--efficiency at most 1, --reserve in [0, 1)"
        )
    if a.grad_bytes not in (2, 4):
        raise PlanError(
            f"--grad-bytes {a.grad_bytes}: 2 (bf16 gradients) or 4 (fp32 main gradients)"
        )
    for name, d in (("--tp", a.tp), ("--pp", a.pp), ("--cp", a.cp)):
        if d is not None and (d < 1 or a.gpus % d):
            raise PlanError(f"{name} {d} does not divide --gpus {a.gpus}")
    if a.cp is not None and c.seq % a.cp:
        raise PlanError(f"--cp {a.cp} does not divide the sequence length {c.seq}")
    if a.pp is not None and c.layers % a.pp:
        raise PlanError(f"--pp {a.pp} does not divide the model's {c.layers} layers")
    if a.tp is not None and (c.heads % a.tp or a.tp > a.gpus_per_node):
        raise PlanError(
            f"--tp {a.tp} must divide the {c.heads} heads and stay inside a node of "
            f"{a.gpus_per_node} GPUs"
        )
    fixed = {k: d for k, d in (("tp", a.tp), ("pp", a.pp), ("cp", a.cp)) if d is not None}
    if a.gpus % math.prod(fixed.values()):
        raise PlanError(
            f"{' x '.join(fixed)} = {' x '.join(map(str, fixed.values()))} = "
            f"{math.prod(fixed.values())} does not divide --gpus {a.gpus}"
        )


def _degrees(c: GPT, a: Assumptions):
    divisors = [d for d in range(1, a.gpus + 1) if a.gpus % d == 0]
    for tp in (
        [a.tp] if a.tp else [d for d in divisors if d <= a.gpus_per_node and c.heads % d == 0]
    ):
        for pp in [a.pp] if a.pp else [d for d in divisors if c.layers % d == 0]:
            for cp in [a.cp] if a.cp else [d for d in divisors if c.seq % d == 0]:
                if (
                    a.gpus % (tp * pp * cp) == 0
                ):  # cp may leave the node (Llama 3 405B: tp 8 x cp 16)
                    yield a.gpus // (tp * pp * cp), tp, pp, cp


def _ring_total(ops: list[tuple[str, float, int]], n: int, alpha: float, beta: float) -> float:
    """Alpha-beta time (beta = 1: bytes sent) of `count` ring collectives of each (op, buffer bytes, count)."""
    return sum(count * ring_time(op, x, n, alpha, beta) for op, x, count in ops)


def evaluate_layout(
    c: GPT, a: Assumptions, dp: int, tp: int, pp: int, cp: int, stage: int, ckpt: bool
) -> dict | None:
    """One configuration: memory per rank (bytes), bytes sent per rank per step, time and MFU; None if the
    global batch does not split into micro-batches over dp."""
    if a.global_batch % (dp * a.micro_batch):
        return None
    m = a.global_batch // (dp * a.micro_batch)  # micro-batches per pipeline per step
    psi = rank_params(c, tp, pp)
    states = zero_mixed_bytes(psi, dp * cp, stage, grad_bytes=a.grad_bytes)
    buckets = (
        a.grad_bytes * psi if stage == 0 and dp * cp > 1 and not a.gradient_as_bucket_view else 0
    )
    s, b, h = c.seq // cp, a.micro_batch, c.hidden
    layer = transformer_layer_activations(
        s, b, h, c.heads, tp, tp > 1, flash_attention=a.flash_attention
    )
    kept = (
        transformer_layer_activations(s, b, h, c.heads, tp, tp > 1, recompute=True)
        if ckpt
        else layer
    )
    act = c.layers / pp * kept * in_flight_micro_batches("1f1b", pp, m) + (layer if ckpt else 0)
    mem = {
        "parameters": states["parameters"],
        "gradients": states["gradients"] + buckets,  # + DDP's buckets
        "optimizer_state": states["optimizer_state"],
        "activations": act,
    }
    mem["total"] = sum(mem.values())
    net, nvl, alpha = a.network_gbps / 8 * 1e9, a.nvlink_gbps / 8 * 1e9, a.alpha_us * 1e-6
    params, grads = (
        2 * psi,
        a.grad_bytes * psi,
    )  # bf16 parameter and gradient bytes of this rank's model part
    n = dp * cp
    # each collective kind once with its count (op, buffer bytes, calls per step): tp and cp run one per layer
    # and micro-batch, up to 10^5 calls a step, each costing the same. A rank holding 1/n of the gradient
    # (ZeRO-2, 3) must reduce-scatter each micro-batch's; ZeRO-3 gathers the parameters twice per micro-batch.
    dp_ops = {
        0: [("all_reduce", grads, 1)],
        1: [("reduce_scatter", grads, 1), ("all_gather", params, 1)],
        2: [("reduce_scatter", grads, m), ("all_gather", params, 1)],
        3: [("reduce_scatter", grads, m), ("all_gather", params, 2 * m)],
    }[stage]
    boundary = (
        2 * s * b * h / tp
    )  # bf16 activations crossing a pipeline or tensor boundary (sequence parallel)
    # tp: 2 all-reduce-sized collectives per layer forward, 2 backward, 2 more in a recomputed forward
    tp_ops = (
        [("all_reduce", 2 * s * b * h, (6 if ckpt else 4) * m * c.layers // pp)] if tp > 1 else []
    )
    # ring attention passes this rank's K and V (2 x boundary) around the cp ring: once forward, twice backward,
    # once more in a recomputed forward
    cp_ops = (
        [("all_gather", 2 * boundary * cp, (4 if ckpt else 3) * m * c.layers // pp)]
        if cp > 1
        else []
    )
    sent = {
        "dp": _ring_total(dp_ops, n, 0, 1),
        "tp": _ring_total(tp_ops, tp, 0, 1),
        "pp": 2 * m * boundary if pp > 1 else 0.0,
        "cp": _ring_total(cp_ops, cp, 0, 1),
    }
    flops = gpt_flops(c, a.global_batch)["total"]
    hardware = flops * (
        4 / 3 if ckpt else 1
    )  # checkpointing runs each forward twice: 8 instead of 6 per weight
    compute = hardware / (a.gpus * a.peak_tflops * 1e12 * a.efficiency) * (1 + (pp - 1) / m)
    across = (
        net if a.gpus > a.gpus_per_node else nvl
    )  # dp and pp leave the node once the job spans nodes
    comm = _ring_total(dp_ops, n, alpha, 1 / across) if n > 1 else 0.0
    cp_link = (
        nvl if tp * cp <= a.gpus_per_node else net
    )  # a ring that leaves the node runs at the network's pace
    comm += _ring_total(tp_ops, tp, alpha, 1 / nvl) + _ring_total(cp_ops, cp, alpha, 1 / cp_link)
    comm += (2 * m * (alpha + boundary / across)) if pp > 1 else 0.0
    step = compute + comm
    return {
        "dp": dp,
        "tp": tp,
        "pp": pp,
        "cp": cp,
        "zero": stage,
        "ckpt": ckpt,
        "micro_batches": m,
        "memory": mem,
        "sent": sent,
        "step_s": step,
        "mfu": mfu(flops, step, a.gpus, a.peak_tflops * 1e12),
        "fits": mem["total"] <= a.gpu_memory_gb * 1e9 * (1 - a.reserve),
    }


def plan(c: GPT, a: Assumptions) -> list[dict]:
    """Every configuration the GPUs allow, fitting or not, fastest first among those that fit."""
    _check(c, a)
    # one rank per ZeRO group (dp x cp = 1): nothing to shard, every stage is DDP's row: list stage 0 only
    rows = [
        evaluate_layout(c, a, dp, tp, pp, cp, stage, ckpt)
        for dp, tp, pp, cp in _degrees(c, a)
        for stage in ((0, 1, 2, 3) if dp * cp > 1 else (0,))
        for ckpt in (False, True)
    ]
    rows = [r for r in rows if r is not None]
    if not rows:
        dps = sorted({dp for dp, *_ in _degrees(c, a)})
        raise PlanError(
            f"--global-batch {a.global_batch} is not a multiple of dp x --micro-batch "
            f"{a.micro_batch} for any dp the degrees leave ({', '.join(map(str, dps))})"
        )
    return sorted(rows, key=lambda r: (not r["fits"], r["step_s"]))
