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


def _memory(c: GPT, a: Assumptions, psi: float, layout: dict, m: int) -> dict:
    """Bytes per rank: mixed-precision states (ZeRO over dp x cp), DDP's buckets, the activations in flight."""
    dp, tp, pp, cp, stage, ckpt = (layout[k] for k in ("dp", "tp", "pp", "cp", "zero", "ckpt"))
    states = zero_mixed_bytes(psi, dp * cp, stage, grad_bytes=a.grad_bytes)
    ddp_copy = stage == 0 and dp * cp > 1 and not a.gradient_as_bucket_view
    buckets = a.grad_bytes * psi if ddp_copy else 0
    s, b, h = c.seq // cp, a.micro_batch, c.hidden
    layer = transformer_layer_activations(
        s, b, h, c.heads, tp, tp > 1, flash_attention=a.flash_attention
    )
    if ckpt:
        kept = transformer_layer_activations(s, b, h, c.heads, tp, tp > 1, recompute=True)
    else:
        kept = layer
    act = c.layers / pp * kept * in_flight_micro_batches("1f1b", pp, m) + (layer if ckpt else 0)
    mem = {
        "parameters": states["parameters"],
        "gradients": states["gradients"] + buckets,  # + DDP's buckets
        "optimizer_state": states["optimizer_state"],
        "activations": act,
    }
    mem["total"] = sum(mem.values())
    return mem


def _collectives(c: GPT, a: Assumptions, psi: float, layout: dict, m: int) -> tuple[dict, float]:
    """Each group's collectives, each kind once with its count: {"dp", "tp", "cp": [(op, buffer bytes, calls
    per step)]}, and the bytes of the activations that cross a pipeline or tensor boundary."""
    tp, pp, cp, stage, ckpt = (layout[k] for k in ("tp", "pp", "cp", "zero", "ckpt"))
    params = 2 * psi  # bf16 parameter bytes of this rank's model part
    grads = a.grad_bytes * psi  # and its gradient bytes
    # tp and cp run one per layer and micro-batch, up to 10^5 calls a step, each costing the same. A rank
    # holding 1/n of the gradient (ZeRO-2, 3) must reduce-scatter each micro-batch's; ZeRO-3 gathers the
    # parameters twice per micro-batch.
    dp_ops = {
        0: [("all_reduce", grads, 1)],
        1: [("reduce_scatter", grads, 1), ("all_gather", params, 1)],
        2: [("reduce_scatter", grads, m), ("all_gather", params, 1)],
        3: [("reduce_scatter", grads, m), ("all_gather", params, 2 * m)],
    }[stage]
    s, b, h = c.seq // cp, a.micro_batch, c.hidden
    boundary = 2 * s * b * h / tp  # bf16 activations crossing a boundary (sequence parallel)
    # tp: 2 all-reduce-sized collectives per layer forward, 2 backward, 2 more in a recomputed forward
    tp_calls = (6 if ckpt else 4) * m * c.layers // pp
    tp_ops = [("all_reduce", 2 * s * b * h, tp_calls)] if tp > 1 else []
    # ring attention passes this rank's K and V (2 x boundary) around the cp ring: once forward, twice
    # backward, once more in a recomputed forward
    cp_calls = (4 if ckpt else 3) * m * c.layers // pp
    cp_ops = [("all_gather", 2 * boundary * cp, cp_calls)] if cp > 1 else []
    return {"dp": dp_ops, "tp": tp_ops, "cp": cp_ops}, boundary


def _step_seconds(a: Assumptions, layout: dict, m: int, ops: dict, boundary: float, flops) -> float:
    """Compute at the assumed efficiency with the 1F1B bubble, plus every collective in the ring alpha-beta
    model on its link (no overlap)."""
    dp, tp, pp, cp, ckpt = (layout[k] for k in ("dp", "tp", "pp", "cp", "ckpt"))
    net, nvl, alpha = a.network_gbps / 8 * 1e9, a.nvlink_gbps / 8 * 1e9, a.alpha_us * 1e-6
    hardware = flops * (
        4 / 3 if ckpt else 1
    )  # checkpointing runs each forward twice: 8, not 6 per weight
    compute = hardware / (a.gpus * a.peak_tflops * 1e12 * a.efficiency) * (1 + (pp - 1) / m)
    across = (
        net if a.gpus > a.gpus_per_node else nvl
    )  # dp and pp leave the node once the job spans nodes
    n = dp * cp
    comm = _ring_total(ops["dp"], n, alpha, 1 / across) if n > 1 else 0.0
    cp_link = (
        nvl if tp * cp <= a.gpus_per_node else net
    )  # a ring that leaves the node: the network's pace
    comm += _ring_total(ops["tp"], tp, alpha, 1 / nvl) + _ring_total(
        ops["cp"], cp, alpha, 1 / cp_link
    )
    comm += (2 * m * (alpha + boundary / across)) if pp > 1 else 0.0
    return compute + comm


def evaluate_layout(
    c: GPT, a: Assumptions, dp: int, tp: int, pp: int, cp: int, stage: int, ckpt: bool
) -> dict | None:
    """One configuration: memory per rank (bytes), bytes sent per rank per step, time and MFU; None if the
    global batch does not split into micro-batches over dp."""
    if a.global_batch % (dp * a.micro_batch):
        return None
    m = a.global_batch // (dp * a.micro_batch)  # micro-batches per pipeline per step
    psi = rank_params(c, tp, pp)
    layout = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "zero": stage, "ckpt": ckpt}
    mem = _memory(c, a, psi, layout, m)
    ops, boundary = _collectives(c, a, psi, layout, m)
    sent = {
        "dp": _ring_total(ops["dp"], dp * cp, 0, 1),
        "tp": _ring_total(ops["tp"], tp, 0, 1),
        "pp": 2 * m * boundary if pp > 1 else 0.0,
        "cp": _ring_total(ops["cp"], cp, 0, 1),
    }
    flops = gpt_flops(c, a.global_batch)["total"]
    step = _step_seconds(a, layout, m, ops, boundary, flops)
    return {
        **layout,
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
