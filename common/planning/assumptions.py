"""What the planner of lesson 21 assumes: the machine (`Assumptions`), the model (a named GPT-style shape, or the
one closest to a parameter count), the error it raises, and `describe`, which prints them.

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
  parameters and gradients; DeepSpeed's estimator adds the largest layer)."""

from __future__ import annotations

from dataclasses import dataclass

from common.planning.cost_model import (
    GPT,
    gpt_params,
)
from common.planning.step_time import gpt_flops

__all__ = ["NAMED", "PlanError", "Assumptions", "shape_for_params", "describe"]


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
