"""Ring attention by hand (lesson 19): causal attention over a sequence split across the cp ranks.

Each cp rank holds the queries, keys and values of S/cp tokens. Keys and values travel around the ring (rank r
sends to r + 1 and receives from r - 1, posted together with batched isend/irecv) while every rank attends its
queries to the block it holds; the partial results merge exactly with the log-sum-exp rule (`merge`). Backward
runs the ring again: dq stays home, the dk/dv of each block travel with it and arrive back at its owner.
The split (`Split`) is contiguous (rank r holds chunk r of cp) or zig-zag (chunks r and 2cp-1-r of 2cp), which
gives every rank the same number of unmasked query-key pairs under a causal mask.
Sources: Liu et al. 2023, Ring Attention (https://arxiv.org/abs/2310.01889); Milakov & Gimelshein 2018,
online softmax (https://arxiv.org/abs/1805.02867); the zig-zag split of zhuzilin/ring-flash-attention.
Ulysses (the heads split instead) is in common/context_parallel/ulysses.py.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "Split",
    "RingStats",
    "owners",
    "off_schedule",
    "block_attention",
    "merge",
    "ring_attention",
    "RingAttention",
    "causal_pairs",
    "time_forward",
]


@dataclass(frozen=True)
class Split:
    """How a sequence of S tokens is cut over cp ranks: `kind` "contiguous" (cp chunks, rank r holds chunk r)
    or "zigzag" (2cp chunks, rank r holds chunks r and 2cp-1-r: a head and a tail)."""

    kind: str
    cp: int

    def __post_init__(self):
        if self.kind not in ("contiguous", "zigzag") or self.cp < 1:
            raise ValueError(
                "Split needs kind 'contiguous' or 'zigzag' and cp >= 1, "
                f"got {self.kind!r}, {self.cp}"
            )

    @property
    def n_chunks(self) -> int:
        return self.cp if self.kind == "contiguous" else 2 * self.cp

    def chunks(self, rank: int) -> list[int]:
        """The chunk indices rank `rank` holds, in the order its local tensor stores them."""
        return [rank] if self.kind == "contiguous" else [rank, 2 * self.cp - 1 - rank]

    def positions(self, rank: int, seq_len: int) -> torch.Tensor:
        """The places in the whole sequence of the tokens rank `rank` holds: (seq_len / cp,) int64."""
        c = self.chunk_len(seq_len)
        return torch.cat([torch.arange(i * c, (i + 1) * c) for i in self.chunks(rank)])

    def chunk_len(self, seq_len: int) -> int:
        if seq_len % self.n_chunks:
            raise ValueError(
                f"sequence length {seq_len} is not divisible into "
                f"{self.n_chunks} {self.kind} chunks"
            )
        return seq_len // self.n_chunks

    def take(self, x: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
        """Rank `rank`'s tokens of the whole-sequence tensor `x` (sequence along `dim`)."""
        return x.index_select(dim, self.positions(rank, x.shape[dim]).to(x.device))


@dataclass
class RingStats:
    """What the ring did on this rank: unmasked query-key pairs computed (per batch element and head), bytes
    handed to isend in each phase, seconds spent computing blocks. `blocks`: None, or a list to which the
    forward appends the key block in hand at each step, as it arrived (`owners` tells whose it is)."""

    pairs: int = 0
    sent: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})
    compute_s: float = 0.0
    blocks: list | None = None


def owners(blocks: list[torch.Tensor], whole_k: torch.Tensor, split: Split) -> list[int]:
    """Whose keys each block is: the rank r whose tokens of `whole_k` (B, H, S, D) it equals exactly, -1 if
    none. Identified from the values that arrived, so a ring that runs the other way shows it (at cp >= 3:
    at cp 2 the next rank is also the previous one)."""
    ranks = range(split.cp)
    return [
        next((r for r in ranks if torch.equal(b, split.take(whole_k, r, 2))), -1) for b in blocks
    ]


def off_schedule(held: list[list[int]], cp: int) -> int:
    """How many (rank r, step s) of `held[r][s]` (the owner of the block rank r held at step s, from `owners`)
    are not rank (r - s) mod cp, plus each step missing or one too many: 0 for a ring that runs forward."""
    wrong = sum(h != (r - s) % cp for r, hs in enumerate(held) for s, h in enumerate(hs))
    return wrong + sum(abs(len(hs) - cp) for hs in held)


def causal_pairs(seq_len: int) -> int:
    """Unmasked query-key pairs of a causal mask on `seq_len` tokens: S (S + 1) / 2."""
    return seq_len * (seq_len + 1) // 2


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """Softmax attention of q (B, H, Sq, D) on one block of keys and values (B, H, Sk, D).

    Returns (out (B, H, Sq, D), lse (B, H, Sq)): lse is the log of the softmax's denominator, log sum_k
    exp(q.k / sqrt(D)), which is what two partial results need to merge. causal: the block is on the
    diagonal (Sq == Sk, the same positions): query i sees keys 0..i.
    """
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Sq, Sk)
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Sq)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Two partial attentions of the same queries on disjoint key blocks -> the attention on both blocks.

    Each is softmax-weighted within its own block; reweight each by its share of the total denominator,
    exp(lse_a - lse) and exp(lse_b - lse), with lse = log(exp(lse_a) + exp(lse_b)). A NaN in either stays NaN.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    out = (
        torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
    )
    return out, lse


def _pass_along(tensors: list[torch.Tensor], group, stats: RingStats, phase: str):
    """Send each tensor to the next cp rank and receive the same shapes from the previous one, all posted in
    one batch (so no rank blocks in a send while its neighbour does too). Counts the bytes at the isend.
    Returns (works, received tensors): wait on the works before reading them."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    right = dist.get_global_rank(group, (rank + 1) % cp)
    left = dist.get_global_rank(group, (rank - 1) % cp)
    tensors = [
        t.contiguous() for t in tensors
    ]  # (a model's k, v are strided views of one projection)
    incoming = [
        torch.empty_like(t) for t in tensors
    ]  # contiguous like them: gloo receives into flat memory
    ops = []
    for t, buf in zip(tensors, incoming):
        stats.sent[phase] += t.numel() * t.element_size()
        ops += [dist.P2POp(dist.isend, t, right, group), dist.P2POp(dist.irecv, buf, left, group)]
    return dist.batch_isend_irecv(ops), incoming


def _pairs_of(my_chunks: list[int], owner_chunks: list[int]):
    """(i, j, diagonal) for each of my query chunks i and the owner's key chunks j that it may see: a key
    chunk after the query chunk is wholly masked and skipped; the same chunk is the causal diagonal."""
    for i, a in enumerate(my_chunks):
        for j, b in enumerate(owner_chunks):
            if b <= a:
                yield i, j, a == b


class RingAttention(torch.autograd.Function):
    """ring_attention's forward and backward (see the module docstring).
    q, k, v: this rank's (B, H, S/cp, D)."""

    @staticmethod
    def forward(ctx, q, k, v, split: Split, group, stats: RingStats):
        rank, cp = (
            (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
        )
        mine, n = split.chunks(rank), len(split.chunks(rank))
        outs, lses = [None] * n, [None] * n
        kv = (k, v)
        for step in range(cp):
            owner = (rank - step) % cp  # whose keys and values this rank holds now
            if stats.blocks is not None:
                stats.blocks.append(kv[0].detach())
            if step < cp - 1:  # start passing them on while computing with them
                works, incoming = _pass_along(list(kv), group, stats, "forward")
            t0 = time.perf_counter()
            qs, ks, vs = q.chunk(n, 2), kv[0].chunk(n, 2), kv[1].chunk(n, 2)
            for i, j, diag in _pairs_of(mine, split.chunks(owner)):
                o, lse = block_attention(qs[i], ks[j], vs[j], causal=diag)
                c = qs[i].shape[2]
                stats.pairs += causal_pairs(c) if diag else c * c
                outs[i], lses[i] = (o, lse) if outs[i] is None else merge(outs[i], lses[i], o, lse)
            stats.compute_s += time.perf_counter() - t0
            if step < cp - 1:
                for w in works:
                    w.wait()
                kv = tuple(incoming)
        out, lse = (
            torch.cat(outs, 2),
            torch.cat(lses, 2),
        )  # every query chunk saw at least its diagonal
        ctx.save_for_backward(q, k, v, out, lse)  # O(S/cp) per rank: no S x S matrix is kept
        ctx.split, ctx.group, ctx.stats = split, group, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        rank, cp = (
            (dist.get_rank(ctx.group), dist.get_world_size(ctx.group))
            if ctx.group is not None
            else (0, 1)
        )
        mine, n = ctx.split.chunks(rank), len(ctx.split.chunks(rank))
        scale = 1 / math.sqrt(q.shape[-1])
        delta = (dout * out).sum(
            -1, keepdim=True
        )  # (B, H, S/cp, 1): rowsum(dO * O) of softmax's backward
        dq = torch.zeros_like(q)
        kv, dkv = (
            (k, v),
            (torch.zeros_like(k), torch.zeros_like(v)),
        )  # dk, dv of the block held, travelling
        for step in range(cp):
            owner = (rank - step) % cp
            if step < cp - 1:
                works, incoming = _pass_along(list(kv), ctx.group, ctx.stats, "backward")
            chunks = [t.chunk(n, 2) for t in (q, dout, lse.unsqueeze(-1), delta, dq, *kv, *dkv)]
            qs, dos, ls, ds, dqs, ks, vs, dks, dvs = chunks  # views: add_ writes into dq and dkv
            for i, j, diag in _pairs_of(mine, ctx.split.chunks(owner)):
                s = qs[i] @ ks[j].transpose(-2, -1) * scale
                if diag:
                    s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
                p = torch.exp(s - ls[i])  # the forward's softmax, rebuilt from the saved lse
                dvs[j].add_(p.transpose(-2, -1) @ dos[i])
                dscore = p * (dos[i] @ vs[j].transpose(-2, -1) - ds[i]) * scale
                dqs[i].add_(dscore @ ks[j])
                dks[j].add_(dscore.transpose(-2, -1) @ qs[i])
            if (
                cp > 1
            ):  # hand the block's dk, dv on; after cp steps each is home, with every rank's share
                dworks, dkv_in = _pass_along(list(dkv), ctx.group, ctx.stats, "backward")
                for w in (*dworks, *(works if step < cp - 1 else ())):
                    w.wait()
                dkv = tuple(dkv_in)
                if step < cp - 1:
                    kv = tuple(incoming)
        return dq, dkv[0], dkv[1], None, None, None


def ring_attention(
    q, k, v, split: Split, group=None, stats: RingStats | None = None
) -> torch.Tensor:
    """Causal attention of this rank's q, k, v (B, H, S/cp, D; tokens laid out by `split`) over the whole
    sequence held by the cp `group` (None: one process, cp = 1). Returns this rank's output
    (B, H, S/cp, D)."""
    return RingAttention.apply(q, k, v, split, group, stats if stats is not None else RingStats())


def time_forward(q, k, v, split: Split, group, reps: int = 3) -> tuple[float, float]:
    """(wall seconds, seconds computing blocks) of this rank's ring forward, the fastest of `reps` runs: wall
    minus compute is the time this rank spent not computing (waiting for its neighbours, or done)."""
    stats, runs = RingStats(), []
    for _ in range(reps):
        stats.compute_s = 0.0
        t0 = time.perf_counter()
        ring_attention(q, k, v, split, group, stats)
        runs.append((time.perf_counter() - t0, stats.compute_s))
    return min(runs)
