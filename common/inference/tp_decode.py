"""Tensor-parallel decoding with the KV cache split by heads (lesson 22), Megatron's split (Shoeybi et al. 2019,
https://arxiv.org/abs/1909.08053, section 3) applied to generation:

    x (B, T, d), replicated -> q, k, v column-parallel: rank r computes heads [r nh/tp, (r+1) nh/tp)
      -> its cache holds only those heads' keys and values (B, nh/tp, max_len, hd)
      -> attention per head (no communication) -> proj row-parallel -> all-reduce 1 (B, T, d)
      -> fc1 column-parallel (4d/tp) -> GELU -> fc2 row-parallel -> all-reduce 2 (B, T, d)

Two all-reduces per layer per forward, of B x T x d elements each: in a decode step T = 1. Embeddings, norms and
the head stay whole on every rank, so every rank computes the same logits and picks the same token (no
broadcast). The split modules are `common.tensor_parallel.layers`' ColumnParallelLinear and RowParallelLinear,
cut from the shared `common.models.CausalTransformer` (its qkv Linear holds q, k, v one after another, each
heads x hd rows). At tp = 1 (no group) the same code is the one-process cached decoder; lesson 22 holds both
to `recompute_decode`, the model itself rerun on the whole prefix every step. `phase_costs` measures prefill
against one decode step (FLOPs per token and per byte read, all-reduces); `ms_per_token` times a decode.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from common.inference.kv_cache import KVCache, cached_attention
from common.measure.counters import count_collectives
from common.models import CausalTransformer
from common.planning.transformer import matmul_attention
from common.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "TPDecoder",
    "count_flops",
    "greedy_decode",
    "ms_per_token",
    "recompute_decode",
    "phase_costs",
]


def _rows(full: nn.Linear, part: int, d: int) -> nn.Linear:
    """q (part 0), k (1) or v (2) of a fused qkv Linear (3d -> d rows) as a Linear of its own."""
    out = nn.Linear(d, d)
    out.weight.data, out.bias.data = (
        full.weight[part * d : (part + 1) * d],
        full.bias[part * d : (part + 1) * d],
    )
    return out


class _TPLayer(nn.Module):
    """One block of the CausalTransformer, rank `tp_rank`'s shards: q, k, v and fc1 column-parallel,
    proj and fc2 row-parallel."""

    def __init__(self, block, heads: int, tp_rank: int, tp_size: int, group):
        super().__init__()
        d = block.ln1.normalized_shape[0]
        self.ln1, self.ln2 = block.ln1, block.ln2
        self.local_heads, self.head_dim = heads // tp_size, d // heads
        self.q, self.k, self.v = (
            ColumnParallelLinear(_rows(block.attn.qkv, i, d), tp_rank, tp_size) for i in range(3)
        )
        self.proj = RowParallelLinear(block.attn.proj, tp_rank, tp_size, group)  # all-reduce 1
        self.fc1 = ColumnParallelLinear(block.mlp[0], tp_rank, tp_size)
        self.fc2 = RowParallelLinear(block.mlp[2], tp_rank, tp_size, group)  # all-reduce 2

    def forward(self, x, cache: KVCache, layer: int, start: int, valid=None) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.ln1(x)
        q, k, v = (
            m(h).view(B, T, self.local_heads, self.head_dim).transpose(1, 2)
            for m in (self.q, self.k, self.v)
        )
        k_all, v_all = cache.write(
            layer, start, k, v
        )  # (B, nh/tp, start + T, hd): this rank's heads only
        y = cached_attention(q, k_all, v_all, start, valid)  # (B, nh/tp, T, hd)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TPDecoder(nn.Module):
    """`model` split over the tp ranks of `group` for generation (None or tp_size 1: the whole model,
    cached).

    forward(tokens (B, T), start, cache, positions=None, valid=None) -> logits (B, T, vocab), the same
    on every rank; it writes the T tokens' keys and values at [start, start + T). positions (B, T):
    each token's place in its own sequence (default start .. start + T - 1; a left-padded batch passes
    its own).
    """

    def __init__(
        self, model: CausalTransformer, heads: int, tp_rank: int = 0, tp_size: int = 1, group=None
    ):
        super().__init__()
        model = copy.deepcopy(model)
        self.tok, self.pos, self.ln_f, self.head = model.tok, model.pos, model.ln_f, model.head
        self.layers = nn.ModuleList(
            _TPLayer(b, heads, tp_rank, tp_size, group) for b in model.blocks
        )
        self.local_heads, self.head_dim = heads // tp_size, model.tok.embedding_dim // heads

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """A cache for this rank's heads: (batch, heads / tp, max_len, head_dim) a layer, keys and values."""
        return KVCache(len(self.layers), batch, self.local_heads, max_len, self.head_dim)

    def forward(
        self, tokens, start: int, cache: KVCache, positions=None, valid=None
    ) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(start, start + tokens.shape[1]).expand_as(tokens)
        x = self.tok(tokens) + self.pos(positions)  # (B, T, d)
        for i, layer in enumerate(self.layers):
            x = layer(x, cache, i, start, valid)
        return self.head(self.ln_f(x))  # (B, T, vocab)


@torch.no_grad()
def greedy_decode(
    decoder: TPDecoder,
    prompt: torch.Tensor,
    new_tokens: int,
    positions=None,
    valid=None,
    cache: KVCache | None = None,
):
    """Prefill `prompt` (B, P), then `new_tokens` greedy decode steps, each one token through the cache.

    positions (B, P) and valid (B, P + new_tokens) describe a left-padded batch (None: no padding); `cache`:
    the decoder's own `new_cache(B, P + new_tokens)` unless given (a lesson passes one to count its bytes).
    Returns tokens (B, new_tokens) and the logits (B, new_tokens, vocab) each was chosen from.
    """
    B, P = prompt.shape
    cache = decoder.new_cache(B, P + new_tokens) if cache is None else cache
    logits = decoder(prompt, 0, cache, positions, valid)[:, -1]  # prefill: P tokens in one forward
    tokens, chosen = [], []
    for step in range(new_tokens):
        chosen.append(logits)
        tokens.append(logits.argmax(-1))  # (B,): the same on every rank (the logits are)
        if step == new_tokens - 1:
            break
        pos = None if positions is None else positions[:, -1:] + step + 1
        logits = decoder(tokens[-1][:, None], P + step, cache, pos, valid)[:, -1]  # decode: T = 1
    return torch.stack(tokens, 1), torch.stack(chosen, 1)


@torch.no_grad()
def recompute_decode(model: CausalTransformer, prompt: torch.Tensor, new_tokens: int):
    """Greedy decoding with no cache: the whole sequence so far through the model at every step (attention as
    matmuls, so FLOPs are counted). Returns tokens (B, new_tokens) and their logits (B, new_tokens, vocab)."""
    model = copy.deepcopy(model).set_attention(matmul_attention)
    seq, tokens, chosen = prompt, [], []
    for _ in range(new_tokens):
        logits = model(seq)[:, -1]  # (B, vocab): every earlier token recomputed
        chosen.append(logits)
        tokens.append(logits.argmax(-1))
        seq = torch.cat([seq, tokens[-1][:, None]], 1)
    return torch.stack(tokens, 1), torch.stack(chosen, 1)


def count_flops(run) -> tuple[object, int]:
    """run()'s result and the FLOPs torch.utils.flop_counter counted in it."""
    with FlopCounterMode(display=False) as counter:
        out = run()
    return out, counter.get_total_flops()


def ms_per_token(decoder: TPDecoder, prompt: torch.Tensor, new_tokens: int) -> float:
    """Wall-clock milliseconds per generated token of `greedy_decode` (prefill included), on this CPU."""
    start = time.perf_counter()
    greedy_decode(decoder, prompt, new_tokens)
    return (time.perf_counter() - start) / new_tokens * 1e3


def phase_costs(dec: TPDecoder, prompt: torch.Tensor) -> dict:
    """Prefill (the P prompt tokens in one forward) against one decode step (the last token at position P),
    on this rank's shards: {"prefill": ..., "decode": ...}, each with the FLOPs per token, the FLOPs per byte
    read (this rank's weights + the cache rows touched), the all-reduce bytes and calls of the forward, and
    the log of its collectives [(op, bytes)] in call order (layer by layer, attention then MLP)."""
    B, P = prompt.shape
    cache = dec.new_cache(B, P + 1)
    weights = sum(p.numel() * p.element_size() for p in dec.parameters())  # this rank's shards
    out = {}
    for phase, tokens, start in (("prefill", prompt, 0), ("decode", prompt[:, -1:], P)):
        with count_collectives() as seen, torch.no_grad():
            _, flops = count_flops(lambda t=tokens, s=start: dec(t, s, cache))
        T = tokens.shape[1]
        read = weights + cache.nbytes() * (start + T) // cache.max_len
        out[phase] = {"flops": flops / (B * T), "intensity": flops / read}
        out[phase]["bytes"] = seen.bytes.get("all_reduce", 0)
        out[phase]["calls"] = seen.calls.get("all_reduce", 0)
        out[phase]["log"] = seen.log
    return out
