"""How much KV cache fits beside the weights at inference (lesson 22): the longest context a batch can reach on
a tensor-parallel group, from `common.planning.cost_model.kv_cache_bytes`.

    longest_context(LLAMA3_70B, tp=8, batch=8, gpu_memory_gb=80)    # {"seq": ..., "weights_gb": ..., ...}

A decoder's shape with grouped-query attention (`Decoder`): the KV cache depends on kv_heads, not on the query
heads. Parameters are counted from the shape (no biases, untied embeddings, SwiGLU's three matrices), so the
weight bytes per rank are 2 x params / tp in bf16 (the embeddings and head split over tp too, as vLLM does).
Not counted: activations of the forward (small in decode), CUDA graphs, the allocator's slack: the `reserve`.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.planning.cost_model import kv_cache_bytes

__all__ = ["Decoder", "LLAMA3_70B", "decoder_params", "largest_batch", "longest_context"]


@dataclass(frozen=True)
class Decoder:
    """A Llama-style decoder: `layers` blocks of attention (heads query heads, kv_heads key/value heads of
    head_dim) and a SwiGLU MLP of `ffn` features, untied embedding and head, RMSNorms."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    source: str


# Meta Llama 3 70B's published configuration (num_hidden_layers, hidden_size, num_attention_heads,
# num_key_value_heads, intermediate_size, vocab_size; head_dim = 8192 / 64).
LLAMA3_70B = Decoder(
    name="Llama-3-70B",
    layers=80,
    hidden=8192,
    heads=64,
    kv_heads=8,
    head_dim=128,
    ffn=28672,
    vocab=128256,
    source="https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json",
)


def decoder_params(c: Decoder) -> int:
    """Parameters counted from the shape: per layer q and o (hidden x heads x head_dim each), k and v (hidden x
    kv_heads x head_dim each), the MLP's gate, up and down (3 x hidden x ffn) and two RMSNorms; the embedding,
    the head (untied) and the final norm."""
    attention = 2 * c.hidden * c.heads * c.head_dim + 2 * c.hidden * c.kv_heads * c.head_dim
    per_layer = attention + 3 * c.hidden * c.ffn + 2 * c.hidden
    return c.layers * per_layer + 2 * c.vocab * c.hidden + c.hidden


def longest_context(
    c: Decoder,
    tp: int,
    batch: int,
    gpu_memory_gb: float = 80.0,
    reserve: float = 0.1,
    element_size: int = 2,
) -> dict:
    """The longest sequence (prompt + generated tokens) every one of `batch` sequences can reach when each of
    the tp GPUs holds its 1/tp of the weights and its heads' KV cache, in `element_size`-byte numbers, with
    `reserve` of the memory kept back. GB = 1e9 bytes."""
    if tp < 1 or batch < 1 or not 0 <= reserve < 1 or not gpu_memory_gb > 0:
        raise ValueError(
            f"tp, batch >= 1, reserve in [0, 1), memory > 0; got {tp}, {batch}, {reserve}"
        )
    usable = gpu_memory_gb * 1e9 * (1 - reserve)
    weights = element_size * decoder_params(c) / tp
    per_token = kv_cache_bytes(c.layers, c.kv_heads, c.head_dim, 1, batch, element_size, tp)
    seq = max(0, int((usable - weights) // per_token))
    return {
        "seq": seq,
        "params": decoder_params(c),
        "weights_gb": weights / 1e9,
        "cache_gb": seq * per_token / 1e9,
        "usable_gb": usable / 1e9,
        "bytes_per_token": per_token,  # per rank, for the whole batch
    }


def largest_batch(
    c: Decoder,
    tp: int,
    seq: int,
    gpu_memory_gb: float = 80.0,
    reserve: float = 0.1,
    element_size: int = 2,
) -> dict:
    """The most sequences of `seq` tokens (prompt + generated) whose KV cache fits beside 1/tp of the
    weights on each of the tp GPUs, `reserve` of the memory kept back; GB = 1e9 bytes."""
    if seq < 1:
        raise ValueError(f"seq >= 1; got {seq}")
    fit = longest_context(c, tp, 1, gpu_memory_gb, reserve, element_size)  # bytes a token, batch 1
    room = fit["usable_gb"] * 1e9 - fit["weights_gb"] * 1e9  # what the cache may take a GPU
    batch = max(0, int(room // (seq * fit["bytes_per_token"])))
    return {**fit, "seq": seq, "batch": batch, "room_gb": room / 1e9}
