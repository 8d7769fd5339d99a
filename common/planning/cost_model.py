"""A cost model of a training step: the bytes a rank holds and the bytes it sends (lesson 21).

Every function is a formula of shapes and counts; none allocates a model. Lesson 21 checks them EXACTLY against
what lessons 08 and 13 measure from tensors (storage bytes, saved activations, collective buffers), then uses them
for models too big to build (`common.planning.planner`).

Memory per rank, Psi = parameters (Rajbhandari et al. 2020, "ZeRO", arxiv.org/abs/1910.02054, section 3.1):
    mixed-precision Adam: 2 Psi (bf16/fp16 parameters) + 2 Psi (their gradients) + K Psi (fp32 master copy,
    momentum and variance: K = 4 + 4 + 4 = 12). Over N data-parallel ranks:
        DDP      (2 + 2 + K) Psi               ZeRO-1  (2 + 2) Psi + K Psi / N
        ZeRO-2   2 Psi + (2 + K) Psi / N       ZeRO-3  (2 + 2 + K) Psi / N   (FSDP2 = ZeRO-3)
    Gradients in fp32 (Megatron-Core's main gradients beside bf16 parameters: `grad_bytes=4`) make ZeRO-1
    (2 + 4) Psi + 12 Psi / N: Megatron's distributed-optimizer table's 6 + 12/d bytes per parameter.
    torch's DDP also keeps a flat copy of the gradients in its buckets (`gradient_as_bucket_view=False`, the
    default), which the paper's baseline leaves out: `sharded_fp32_bytes` counts it ("ddp_buckets").
Activations per transformer layer (Korthikanti et al. 2022, arxiv.org/abs/2205.05198, section 4), 16-bit,
sequence s, micro-batch b, hidden h, heads a, tensor-parallel t:
    no parallelism             s b h (34 + 5 a s / h)
    tensor parallel            s b h (10 + 24 / t + 5 a s / (h t))
    tensor + sequence parallel s b h (34 + 5 a s / h) / t
    full recomputation         2 s b h (only the layer's input is kept)
Bytes one rank sends in the ring model (lesson 02): all-reduce 2 B (N-1)/N, all-gather / reduce-scatter B (N-1)/N,
`common.measure.bandwidth.ring_bytes_sent`, the one home of these factors.
The FLOPs and the time of a step: common/planning/step_time.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from common.measure.bandwidth import ring_bytes_sent

__all__ = [
    "ADAM_MIXED_K",
    "zero_mixed_bytes",
    "sharded_fp32_bytes",
    "residual_mlp_layout_bytes",
    "tp_layer_params",
    "tp_all_reduces",
    "digits_transformer_tp_bytes",
    "residual_mlp_activations",
    "transformer_layer_activations",
    "zero_paper_activations",
    "GPT",
    "gpt_params",
    "in_flight_micro_batches",
    "kv_cache_bytes",
]

ADAM_MIXED_K = 12  # fp32 master parameters + momentum + variance: 4 + 4 + 4 bytes per parameter


def zero_mixed_bytes(
    n_params: float, n_ranks: int, stage: int, k: int = ADAM_MIXED_K, grad_bytes: int = 2
) -> dict[str, float]:
    """Bytes per rank of parameters, gradients and optimizer state, mixed-precision Adam, ZeRO stage 0 (DDP)..3.

    Stage s shards the first s of (optimizer state, gradients, parameters) over `n_ranks`. `grad_bytes`: 2 for
    bf16 gradients (the ZeRO paper's), 4 for fp32 main gradients (Megatron-Core's, with bf16 parameters).
    """
    if stage not in (0, 1, 2, 3) or n_ranks < 1 or n_params < 0 or grad_bytes not in (2, 4):
        raise ValueError(
            f"stage in 0..3, n_ranks >= 1, n_params >= 0, grad_bytes 2 or 4; got {stage}, "
            f"{n_ranks}, {n_params}, {grad_bytes}"
        )
    div = [
        n_ranks if stage >= i else 1 for i in (3, 2, 1)
    ]  # parameters, gradients, optimizer state
    out = {
        "parameters": 2 * n_params / div[0],
        "gradients": grad_bytes * n_params / div[1],
        "optimizer_state": k * n_params / div[2],
    }
    out["total"] = sum(out.values())
    return out


def sharded_fp32_bytes(
    unit_numels: Sequence[int],
    tensors: int,
    n_ranks: int,
    stage: int,
    element_size: int = 4,
    adam_slots: int = 2,
) -> dict[str, float]:
    """EXACT bytes per rank of fp32 training with Adam: DDP (stage 0) or lesson 13's ZeRO by hand (1..3).

    unit_numels: elements of each flat unit (lesson 13: the stem, each block, the head); `tensors`: the model's
    parameter tensors (DDP's Adam keeps one 4-byte `step` per tensor; ZeRO's Adam one per unit shard).
    ZeRO pads a unit of n elements to N x s, s = ceil(n / N); the model's parameters are views of the padded
    flat buffer (stages 1-2), which stage 3 frees between uses, keeping only its shard of s elements.
    Gradients are those held at the end of backward: all of them (DDP, stage 1) or the shards (stages 2-3).
    `ddp_buckets` (DDP only): torch's DDP all-reduces flat bucket buffers, a second copy of the gradients
    unless `gradient_as_bucket_view=True` (lesson 08); none in a world of one, which runs without DDP.
    `sent`: ring-model bytes per rank per step: DDP all-reduce 2 Psi (N-1)/N, stages 1-2 reduce-scatter +
    all-gather, stage 3 one more all-gather (before backward): Psi the (padded) buffer bytes.
    """
    N, e = n_ranks, element_size
    numel = sum(unit_numels)
    shard = sum(math.ceil(n / N) for n in unit_numels)
    padded = N * shard
    if stage == 0:
        return {
            "parameters": e * numel,
            "gradients": e * numel,
            "ddp_buckets": e * numel if N > 1 else 0,
            "optimizer_state": adam_slots * e * numel + 4 * tensors,
            "sent": ring_bytes_sent("all_reduce", e * numel, N),
        }
    gathers = 2 if stage == 3 else 1
    return {
        "parameters": e * (shard if stage == 3 else padded),
        "gradients": e * (numel if stage == 1 else shard),
        "optimizer_state": adam_slots * e * shard + 4 * len(unit_numels),
        "sent": (
            gathers * ring_bytes_sent("all_gather", e * padded, N)
            + ring_bytes_sent("reduce_scatter", e * padded, N)
        ),
    }


def residual_mlp_layout_bytes(width: int, depth: int, batch: int, n_ranks: int) -> dict[str, dict]:
    """Lesson 13's ResidualMLP(width, depth) at `batch` samples per rank on `n_ranks`: the `sharded_fp32_bytes`
    of DDP (with its activations, plain and checkpointed) and of ZeRO-1, 2 and 3. Units: the stem Linear(64, w),
    each block's two Linear(w, w), the head Linear(w, 10); every Linear has a bias."""
    w = width
    numels = [64 * w + w, *[2 * (w * w + w)] * depth, w * 10 + 10]
    tensors = 2 * (2 + 2 * depth)  # a weight and a bias per Linear
    rows = {
        "DDP": {
            **sharded_fp32_bytes(numels, tensors, n_ranks, 0),
            "activations": residual_mlp_activations(batch, w, depth),
            "activations_checkpointed": residual_mlp_activations(
                batch, w, depth, checkpointing=True
            ),
        }
    }
    for stage in (1, 2, 3):
        rows[f"ZeRO-{stage}"] = sharded_fp32_bytes(numels, tensors, n_ranks, stage)
    return rows


def tp_layer_params(h: int, tp: int) -> int:
    """Parameters of one transformer layer on a tensor-parallel rank (Megatron: q, k, v and fc1 column-parallel,
    proj and fc2 row-parallel): the weights 12 h^2 and the column-parallel biases 7 h split by tp; the two
    row-parallel biases (2 h) and the two LayerNorms (4 h) whole on every rank."""
    return (12 * h * h + 7 * h) // tp + 6 * h


def tp_all_reduces(
    layers: int, tp: int, tokens: int, h: int, element_size: int = 4
) -> dict[str, int]:
    """The all-reduces of one forward + backward of `layers` tensor-parallel layers (attention and MLP each: g
    forward, f backward), each on the (tokens, h) activations; none at tp = 1 (f and g are identities)."""
    calls = 4 * layers if tp > 1 else 0
    return {"calls": calls, "bytes": calls * tokens * h * element_size}


def digits_transformer_tp_bytes(h: int, layers: int, tp: int, tokens: int) -> dict[str, int]:
    """Lesson 10's transformer on the digits at tensor-parallel degree `tp`: the fp32 parameter bytes a rank
    holds (embedding Linear(8, h) and head Linear(h, 10) whole on every rank, each layer split as Megatron does)
    and the all-reduces of one forward + backward on `tokens` rows."""
    ar = tp_all_reduces(layers, tp, tokens, h)
    params = 8 * h + h + layers * tp_layer_params(h, tp) + 10 * h + 10
    return {
        "parameters": 4 * params,
        "all_reduce_calls": ar["calls"],
        "all_reduce_bytes": ar["bytes"],
    }


def residual_mlp_activations(
    batch: int,
    width: int,
    depth: int,
    checkpointing: bool = False,
    in_features: int = 64,
    element_size: int = 4,
) -> int:
    """Saved-activation bytes of lesson 08's ResidualMLP: what each layer keeps for its backward.

    Linear keeps its input, GELU its input. stem Linear(64): (B, 64); a block Linear -> GELU -> Linear: 3 x (B, w);
    head GELU -> Linear: 2 x (B, w). Checkpointing a block keeps its input only: 1 x (B, w).
    """
    kept = {
        "stem": in_features,
        "blocks": depth * width * (1 if checkpointing else 3),
        "head": 2 * width,
    }
    return element_size * batch * sum(kept.values())


def transformer_layer_activations(
    s: int,
    b: int,
    h: int,
    a: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: bool = False,
    flash_attention: bool = False,
) -> float:
    """Korthikanti et al. 2022: activation bytes of one transformer layer (16-bit, with dropout masks).

    flash_attention: the kernel keeps no s x s scores (it recomputes them in backward), so the 5 a s / h term
    (softmax output 2, dropout mask 1, dropout output 2 bytes per score) is dropped."""
    if recompute:
        return 2 * s * b * h / (tp if sequence_parallel else 1)
    scores = 0 if flash_attention else 5 * a * s / h
    if sequence_parallel:
        return s * b * h * (34 + scores) / tp
    return s * b * h * (10 + 24 / tp + scores / tp)


def zero_paper_activations(h: int, b: int, s: int, layers: int, element_size: int = 2) -> float:
    """ZeRO paper, section 3.2: a GPT-2-like model keeps about 12 x hidden x batch x sequence x layers values."""
    return element_size * 12 * h * b * s * layers


@dataclass(frozen=True)
class GPT:
    """A GPT-style decoder: `layers` blocks of (LayerNorm, attention, LayerNorm, 4h MLP), learned positions,
    untied output head, every Linear with a bias (common.planning.transformer builds exactly this)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int


def gpt_params(c: GPT) -> dict[str, int]:
    """Parameters by kind. Per layer: qkv 3h^2 + 3h, projection h^2 + h, MLP 8h^2 + 5h, two LayerNorms 4h."""
    h = c.hidden
    per_layer = 12 * h * h + 13 * h
    out = {
        "embeddings": c.vocab * h + c.seq * h,
        "layers": c.layers * per_layer,
        "final_norm": 2 * h,
        "head": h * c.vocab + c.vocab,
    }
    out["total"] = sum(out.values())
    return out


def in_flight_micro_batches(schedule: str, stages: int, micro_batches: int, stage: int = 0) -> int:
    """Micro-batches whose activations a pipeline stage holds at its peak: GPipe runs every forward first (all
    m); 1F1B starts backward after `stages - stage` forwards (stage 0 holds pp, the last stage 1)."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(stages - stage, micro_batches)
    raise ValueError(f"schedule is 'gpipe' or '1f1b', got {schedule!r}")


def kv_cache_bytes(
    layers: int,
    kv_heads: int,
    head_dim: int,
    seq: int,
    batch: int,
    element_size: int = 2,
    tp: int = 1,
) -> int:
    """Bytes of the KV cache on one tensor-parallel rank: 2 (keys and values) x layers x kv_heads / tp x head_dim x
    seq x batch x element size. Heads split over tp; where tp exceeds kv_heads (grouped-query attention with few
    kv heads) each rank keeps one, replicated, as Megatron does: ceil(kv_heads / tp). Lesson 22 checks it
    exactly against the cache's tensors."""
    if min(layers, kv_heads, head_dim, seq, batch, element_size, tp) < 1:
        raise ValueError("every size of the KV cache must be >= 1")
    return 2 * layers * math.ceil(kv_heads / tp) * head_dim * seq * batch * element_size
