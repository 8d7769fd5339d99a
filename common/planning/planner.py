"""The planner of lesson 21: which (dp, tp, pp, cp, ZeRO stage, checkpointing) fits a GPT-style model on G GPUs,
with its memory per rank, bytes sent per step and an estimated step time and MFU. Formulas only
(common/planning/cost_model.py, checked against measurement by lesson 21); no model is built, nothing is allocated.

    rows = plan(GPT(80, 8192, 64, 32000, 4096), Assumptions(gpus=64, gpu_memory_gb=80))

The command line around it (lesson 21's --params / --model flags and the printed table) is
common/planning/cli.py.

The assumptions (printed by `describe`):
- mixed-precision Adam, 2 + g + 12 bytes per parameter: bf16 parameters, gradients of g bytes (`grad_bytes`: 2
  bf16, the ZeRO paper's; 4 fp32 main gradients, Megatron-Core's: ZeRO-1 then holds 6 + 12/d, its distributed
  optimizer's table), fp32 master copy, momentum and variance; ZeRO / FSDP2 shards over the dp x cp ranks (they
  hold the same parameters); stage 0 is torch's DDP, whose buckets keep a second copy of the gradients unless
  `gradient_as_bucket_view`.
- tensor parallelism (Megatron) splits every Linear, replicates LayerNorms and the row-parallel biases (6 h per
  layer), and runs sequence parallelism: activations per layer s b h (34 + 5 a s / h) / tp (Korthikanti et al.
  2022; with flash attention, the default, without the 5 a s / h of attention scores); context parallelism
  divides s by cp; full activation checkpointing keeps 2 s b h per layer plus one layer's activations.
- pipeline: 1F1B, the first stage (which also holds the embeddings) holds min(pp, m) micro-batches in flight;
  bubble (pp - 1) / m.
- data parallel, per step of m micro-batches: DDP and ZeRO-1 accumulate whole gradients and reduce once; ZeRO-2
  holds only its gradient shard, so it reduce-scatters after every micro-batch (DeepSpeed refuses `no_sync`
  under stages 2 and 3 for this reason) and all-gathers the updated parameters once; ZeRO-3 also all-gathers the
  parameters for every micro-batch's forward and again for its backward.
- time: FLOPs at `efficiency` x peak (itself an assumption: the time is an estimate, not a bound either way);
  every collective in the ring alpha-beta model with no overlap; tp inside a node (NVLink), cp on NVLink while
  tp x cp fits in a node and on the network beyond, dp and pp on the network once the job spans nodes (on
  NVLink when every GPU is in one node). Not counted: the unit ZeRO-3 gathers at a time (about one layer's bf16
  parameters and gradients; DeepSpeed's estimator adds the largest layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.planning.cost_model import (
    GPT,
    gpt_flops,
    gpt_params,
    in_flight_micro_batches,
    mfu,
    ring_time,
    tp_layer_params,
    transformer_layer_activations,
    zero_mixed_bytes,
)

__all__ = [
    "NAMED",
    "Assumptions",
    "PlanError",
    "shape_for_params",
    "rank_params",
    "plan",
    "describe",
    "evaluate_layout",
]

NAMED = {
    "gpt2-1.5b": GPT(48, 1600, 25, 50257, 1024),
    "7b": GPT(32, 4096, 32, 32000, 4096),
    "13b": GPT(40, 5120, 40, 32000, 4096),
    "70b": GPT(80, 8192, 64, 32000, 4096),
    "175b": GPT(96, 12288, 96, 50257, 2048),
}  # GPT-style shapes of those sizes (not any released model)


class PlanError(ValueError):
    """Bad input, or nothing fits: the lesson prints it as one line and exits 2."""


@dataclass(frozen=True)
class Assumptions:
    gpus: int
    gpu_memory_gb: float = 80.0
    gpus_per_node: int = 8
    global_batch: int = 512  # sequences per optimizer step
    micro_batch: int = 1  # sequences per micro-batch
    peak_tflops: float = 989.0  # dense bf16 of an H100 SXM
    efficiency: float = 0.5  # the fraction of peak a matmul-heavy step reaches
    network_gbps: float = 400.0  # per GPU, across nodes (gigabits per second)
    nvlink_gbps: float = 3600.0  # per GPU, inside a node (450 GB/s)
    alpha_us: float = 10.0  # latency of one ring step
    reserve: float = (
        0.1  # of GPU memory kept back (allocator fragmentation, workspaces, the CUDA context)
    )
    flash_attention: bool = True  # no s x s attention scores kept for backward
    grad_bytes: int = (
        2  # 2: bf16 gradients; 4: fp32 main gradients (Megatron-Core with bf16 parameters)
    )
    gradient_as_bucket_view: bool = (
        False  # torch DDP's default: its buckets are a second copy of the gradients
    )
    tp: int | None = None  # fix a degree instead of searching it
    pp: int | None = None
    cp: int | None = None


def shape_for_params(params: float, seq: int = 4096, vocab: int = 32000) -> GPT:
    """The GPT-style shape closest to `params` parameters with layers a multiple of 8, hidden a multiple of 1024
    between 64 and 160 x layers (the GPT-3 family's ratios), heads of 128 (so tp = 1, 2, 4, 8 divide them)."""
    if not params >= 1e8:  # also NaN
        raise PlanError(
            f"--params {params:g}: give at least 1e8 (the planner is for models too big to build)"
        )
    shapes = [
        GPT(layers, hidden, hidden // 128, vocab, seq)
        for layers in range(8, 257, 8)
        for hidden in range(1024, 65537, 1024)
        if 64 <= hidden / layers <= 160
    ]
    return min(shapes, key=lambda c: abs(gpt_params(c)["total"] - params))


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


def describe(c: GPT, a: Assumptions) -> list[str]:
    p = gpt_params(c)["total"]
    grads = "bf16" if a.grad_bytes == 2 else "fp32 main gradients"
    buckets = (
        "are views of the gradients"
        if a.gradient_as_bucket_view
        else "hold a second copy of the gradients"
    )
    flops = gpt_flops(c, a.global_batch)["total"]
    attention = "flash attention" if a.flash_attention else "attention scores kept"
    return [
        f"model: {c} = {p / 1e9:.2f}e9 parameters",
        (
            f"  {flops:.3g} FLOPs per step (global batch {a.global_batch} x {c.seq} tokens, micro-batch "
            f"{a.micro_batch})"
        ),
        (
            f"machine: {a.gpus} GPUs of {a.gpu_memory_gb:g} GB ({a.reserve:.0%} kept back), {a.gpus_per_node} "
            f"per node; peak {a.peak_tflops:g} TFLOP/s at {a.efficiency:.0%}"
        ),
        f"  network {a.network_gbps:g} Gb/s, NVLink {a.nvlink_gbps:g} Gb/s per GPU, alpha {a.alpha_us:g} us",
        f"assumed: mixed-precision Adam 2+{a.grad_bytes}+12 B/param (gradients {grads}); DDP's buckets {buckets}",
        "  ZeRO over dp x cp, stages 2 and 3 reduce-scatter every micro-batch; TP with sequence parallelism; 1F1B",
        f"  {attention}; no compute/communication overlap; the time is an estimate (compute at the assumed efficiency)",
        "  not counted: the unit ZeRO-3 gathers at a time (about one layer's parameters and gradients)",
    ]
