"""A mixture-of-experts layer, in one process and with its experts spread over ranks (expert parallelism).

    moe = MoE(hidden=32, experts=4, k=2, capacity_factor=1.0)     # one process: every expert here
    y = moe(x)                                                     # x, y (N, H): N tokens
    ep_moe = ExpertParallelMoE(moe, ep_rank, ep, group)            # this rank keeps experts E/ep * ep_rank ...
    y = ep_moe(x_local)                                            # tokens travel by all-to-all and come back

Routing (Switch Transformer, Fedus et al. 2021, https://arxiv.org/abs/2101.03961; GShard, Lepikhin et al.
2020): the router scores each token against the E experts, softmax over E, keeps the top k and (for k > 1)
renormalizes their weights to sum to 1. Each expert takes at most C = ceil(capacity_factor * N * k / E)
assignments of a batch of N tokens; the rest are dropped in a fixed order (every token's first choice before
any second choice, tokens in order). A dropped assignment contributes 0, so a token whose every choice is
dropped gets a layer output of exactly 0 and the block's residual connection carries it through unchanged.
The auxiliary load-balancing loss is E * sum_e f_e * P_e: f_e the fraction of assignments routed to expert e
(counted, no gradient), P_e the router's mean probability for e (differentiable); 1.0 when perfectly balanced.

Capacity is counted per rank, on the rank's own N tokens, as GShard (its "groups") and the Switch Transformer do,
so the one-process reference of an EP run is this MoE applied to each rank's tokens separately (`MoE` per
chunk). Not every system caps experts: MegaBlocks (dropless, block-sparse), Megatron-Core by default (no
capacity factor) and DeepSeek-V3 drop no token at all, and pay with uneven expert loads instead.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F

from common.measure.differences import max_abs_diff, nan_max

__all__ = [
    "Expert",
    "MoE",
    "ExpertParallelMoE",
    "AllToAll",
    "route",
    "capacity",
    "keep_mask",
    "histogram",
    "balance_loss",
    "dispatch_plan",
    "all_to_all_traffic",
    "check_moe_options",
    "kept_choices_only",
    "all_to_all_vs_torch",
]


class Expert(nn.Module):
    """One expert: a small MLP, H -> F -> H."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def check_moe_options(experts: int, k: int, capacity_factor: float, ep: int = 1) -> None:
    """Raise ValueError with one line naming the bad option (a lesson turns it into exit 2 on every rank)."""
    if experts < 1 or k < 1 or k > experts:
        raise ValueError(f"--top-k {k} must be between 1 and the number of experts {experts}")
    if not 0 < capacity_factor <= 1000:  # from E / k on, nothing is ever dropped (C >= N)
        raise ValueError(f"--capacity-factor must be in (0, 1000], got {capacity_factor}")
    if experts % ep:
        raise ValueError(
            f"--experts {experts} must be divisible by ep = {ep} (each rank holds E/ep experts)"
        )


def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (N, E) -> probs (N, E) softmax over experts, weights (N, k), idx (N, k). For k > 1 the top-k
    weights are renormalized to sum to 1 (Mixtral); at k = 1 that would be the constant 1, leaving the router
    no gradient from the task, so top-1 keeps the probability itself (Switch Transformer)."""
    probs = logits.softmax(-1)
    top, idx = probs.topk(k, dim=-1)  # ties: torch picks the lower index, the same on every rank
    return probs, (top / top.sum(-1, keepdim=True) if k > 1 else top), idx


def capacity(tokens: int, experts: int, k: int, factor: float) -> int:
    """C = ceil(factor * N * k / E): the most assignments one expert takes from a batch of N tokens."""
    return math.ceil(factor * tokens * k / experts)


def keep_mask(idx: torch.Tensor, experts: int, cap: int) -> torch.Tensor:
    """idx (N, k) -> bool (N, k): which assignments fit in their expert's capacity. Order: all first choices
    (tokens in order), then all second choices, ..."""
    flat = idx.t().reshape(-1)  # (k*N,) slot-major
    onehot = F.one_hot(flat, experts)  # (k*N, E)
    position = (onehot.cumsum(0) * onehot).sum(
        -1
    ) - 1  # this assignment's place in its expert's queue
    return (position < cap).view(idx.shape[1], idx.shape[0]).t()


def histogram(idx: torch.Tensor, experts: int) -> torch.Tensor:
    """Assignments per expert, (E,) int64."""
    return torch.bincount(idx.reshape(-1), minlength=experts)


def balance_loss(probs: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss E * sum_e f_e * P_e (f counted over all k choices, P the mean prob)."""
    experts = probs.shape[-1]
    f = histogram(idx, experts).to(probs.dtype) / idx.numel()
    return experts * (f * probs.mean(0)).sum()


class MoE(nn.Module):
    """E experts and a top-k router, all in this process. After each forward, `self.stats` holds the routing:
    counts (E,) assignments per expert before capacity, kept (E,) after, cap, dropped, aux (the balance loss)."""

    def __init__(
        self, hidden: int, experts: int, k: int = 2, capacity_factor: float = 1.25, ffn: int = 0
    ):
        super().__init__()
        check_moe_options(experts, k, capacity_factor)
        self.num_experts, self.k, self.capacity_factor = experts, k, capacity_factor
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, ffn or 2 * hidden) for _ in range(experts))
        self.stats: dict = {}

    def _route(self, x: torch.Tensor):
        probs, weights, idx = route(self.router(x), self.k)  # (N, E), (N, k), (N, k)
        cap = capacity(x.shape[0], self.num_experts, self.k, self.capacity_factor)
        keep = keep_mask(idx, self.num_experts, cap)
        kept = histogram(idx[keep], self.num_experts)
        self.stats = {
            "counts": histogram(idx, self.num_experts),
            "kept": kept,
            "cap": cap,
            "idx": idx,
            "keep": keep,
            "dropped": idx.numel() - int(kept.sum()),
            "aux": balance_loss(probs, idx),
        }
        return weights, idx, keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx, keep = self._route(x)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = ((idx == e) & keep).nonzero(as_tuple=True)
            if len(tok):
                y = y.index_add(0, tok, weights[tok, slot, None] * expert(x[tok]))
        return y  # a token whose every choice was dropped: exactly 0 here


_TRAFFIC: list | None = (
    None  # (what, rows sent, bytes sent to other ranks, bytes sent in all) per call
)


@contextmanager
def all_to_all_traffic() -> Iterator[list]:
    """Inside the block, every all-to-all of this module appends (what, rows, bytes to others, bytes) to the list."""
    global _TRAFFIC
    _TRAFFIC = []
    try:
        yield _TRAFFIC
    finally:
        _TRAFFIC = None


def _all_to_all(
    x: torch.Tensor, out_splits: list, in_splits: list, group, what: str
) -> torch.Tensor:
    """dist.all_to_all_single: rows in_splits[d] of x go to rank d; out_splits[s] rows arrive from rank s."""
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    if _TRAFFIC is not None:
        me, row = dist.get_rank(group), math.prod(x.shape[1:]) * x.element_size()  # bytes per row
        _TRAFFIC.append(
            (what, sum(in_splits), (sum(in_splits) - in_splits[me]) * row, sum(in_splits) * row)
        )
    return out


class AllToAll(torch.autograd.Function):
    """A differentiable all_to_all_single. Forward: rows go out by in_splits, arrive by out_splits. Backward:
    the gradient of each received row goes back to the rank it came from: the same call, splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, what):
        ctx.splits, ctx.group, ctx.what = (out_splits, in_splits), group, what
        return _all_to_all(x, out_splits, in_splits, group, what)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return (
            _all_to_all(grad, in_splits, out_splits, ctx.group, ctx.what + " backward"),
            None,
            None,
            None,
            None,
        )


def dispatch_plan(idx: torch.Tensor, keep: torch.Tensor, experts_per_rank: int, ep: int):
    """Which kept assignments go where. Returns tok, slot (the assignments, sorted by expert: grouped by
    destination rank) and send (ep,) the rows for each rank: send[d] = kept assignments to experts on rank d."""
    tok, slot = keep.nonzero(as_tuple=True)
    order = torch.argsort(idx[tok, slot], stable=True)  # group by expert, hence by rank
    tok, slot = tok[order], slot[order]
    send = torch.bincount(idx[tok, slot] // experts_per_rank, minlength=ep)
    return tok, slot, send


class ExpertParallelMoE(MoE):
    """The same MoE with its experts spread over the `ep` ranks of `group`: rank r keeps experts
    r*E/ep ... (r+1)*E/ep - 1 (copied from `full`), the router is replicated. Forward: route here, exchange
    the split sizes, dispatch the token rows, run the local experts, combine with the reverse all-to-all."""

    def __init__(self, full: MoE, ep_rank: int, ep: int, group):
        nn.Module.__init__(self)
        check_moe_options(full.num_experts, full.k, full.capacity_factor, ep)
        self.num_experts, self.k, self.capacity_factor = (
            full.num_experts,
            full.k,
            full.capacity_factor,
        )
        self.ep_rank, self.ep, self.group, self.local = ep_rank, ep, group, full.num_experts // ep
        self.router = nn.Linear(full.router.in_features, full.num_experts, bias=False)
        self.router.load_state_dict(full.router.state_dict())
        first = ep_rank * self.local
        self.experts = nn.ModuleList()
        for e in range(first, first + self.local):
            expert = Expert(full.router.in_features, full.experts[e].fc1.out_features)
            expert.load_state_dict(full.experts[e].state_dict())
            self.experts.append(expert)
        self.stats = {}

    def _exchange(self, x, out_splits, in_splits, what):
        if self.group is None:  # ep = 1: nothing travels
            return x
        return AllToAll.apply(x, out_splits, in_splits, self.group, what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx, keep = self._route(x)
        tok, slot, send = dispatch_plan(idx, keep, self.local, self.ep)
        recv = send.clone()
        if (
            self.group is not None
        ):  # 1. the split sizes first: how many rows each rank will receive from me
            dist.all_to_all_single(recv, send, group=self.group)
            if _TRAFFIC is not None:
                _TRAFFIC.append(("split sizes", self.ep, (self.ep - 1) * 8, self.ep * 8))
        self.stats.update(send=send, recv=recv)
        send_l, recv_l = send.tolist(), recv.tolist()
        rows = self._exchange(x[tok], recv_l, send_l, "dispatch")  # 2. (sum(recv), H)
        local_e = self._exchange(idx[tok, slot] % self.local, recv_l, send_l, "expert ids")
        # zeros that stay in the graph: every rank must run the backward all-to-alls, also one that received
        # no row (zeros_like would cut the graph there and leave the other ranks waiting for its call)
        out = rows * 0
        for e, expert in enumerate(self.experts):  # 3. the local experts
            where = (local_e == e).nonzero(as_tuple=True)[0]
            if len(where):
                out = out.index_copy(0, where, expert(rows[where]))
        back = self._exchange(out, send_l, recv_l, "combine")  # 4. (sum(send), H), my order
        return torch.zeros_like(x).index_add(0, tok, weights[tok, slot, None] * back)


def kept_choices_only(moe: MoE, x: torch.Tensor, keep: torch.Tensor, k: int) -> torch.Tensor:
    """Each token again, one at a time, from its kept choices only: sum_j weight_j x expert_j(x) over the
    choices j that `keep` (N, k) kept; the weights as the router gave them (not renormalized)."""
    _, weights, idx = route(moe.router(x), k)
    rows = []
    for t in range(len(x)):
        row = torch.zeros(x.shape[1])
        for j in range(k):
            if keep[t, j]:
                row = row + weights[t, j] * moe.experts[idx[t, j]](x[t])
        rows.append(row)
    return torch.stack(rows)


def all_to_all_vs_torch(group, rank: int, size: int, hidden: int) -> float:
    """`AllToAll` against torch.distributed.nn.functional.all_to_all_single, uneven splits differing by rank:
    max |difference| of the rows received and of the input gradients, on this rank (lesson 20)."""
    send = [(rank + d) % 3 + 1 for d in range(size)]  # uneven splits, different on every rank
    recv = [(s + rank) % 3 + 1 for s in range(size)]  # what rank s sends me: its send[rank]
    x = torch.randn(sum(send), hidden)
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1 = AllToAll.apply(ours, recv, send, group, "check")
    with warnings.catch_warnings():  # torch 2.13: deprecated, pointing to _functional_collectives
        warnings.simplefilter("ignore", FutureWarning)
        out = torch.empty(sum(recv), hidden)
        y2 = dist_nn.all_to_all_single(out, theirs, recv, send, group=group)
    weight = torch.randn(sum(recv), hidden)
    (y1 * weight).sum().backward()
    (y2 * weight).sum().backward()
    return nan_max([max_abs_diff(y1, y2), max_abs_diff(ours.grad, theirs.grad)])
