"""Training lesson 20's model with its experts spread over ranks, held to the same model in one process.

    full, split = build_pair(hidden, heads, MoE(...), grid)   # the one-process model and its EP copy
    reduce_grads(split, grid)                                 # experts summed over dp, the rest over the world
    param_gap(full, split)                                    # max |EP parameter - one-process parameter|

Where the gradients are summed: an expert lives once in each ep group, and the backward all-to-all already
brought it the gradient of every token of that group, so its copies are only across dp (one all-reduce in the
dp group); everything else (router, attention, embeddings) is replicated on every rank (one all-reduce in the
world). A parameter that backward reached on no rank keeps `.grad = None`, as one process leaves it.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from common.expert_parallel.model import (
    EXPERTS,
    digit_tokens,
    imbalance,
    moe_of,
    moe_transformer,
    next_token_loss,
    set_moe,
)
from common.expert_parallel.moe import ExpertParallelMoE, MoE
from common.harness.grid import Grid
from common.harness.session import set_seed
from common.measure.differences import max_abs_diff, nan_max
from common.models import CausalTransformer

__all__ = [
    "grad_of",
    "expert_grads",
    "one_process_layer",
    "build_pair",
    "param_gap",
    "reduce_grads",
    "balance_runs",
]


def grad_of(p: torch.Tensor) -> torch.Tensor:
    """p.grad, or zeros where backward never reached p (an expert that got no token)."""
    return torch.zeros_like(p) if p.grad is None else p.grad


def expert_grads(full: MoE, split: ExpertParallelMoE) -> float:
    """max |gradient difference| over this rank's experts and their one-process copies."""
    first, gaps = split.ep_rank * split.local, []
    for i, expert in enumerate(split.experts):
        for p, q in zip(expert.parameters(), full.experts[first + i].parameters()):
            gaps.append(
                max_abs_diff(grad_of(p), grad_of(q))
            )  # an expert no token reached: no .grad
    return nan_max(gaps)


def one_process_layer(full: MoE, xf: torch.Tensor) -> tuple[list, torch.Tensor]:
    """The one-process reference of an EP layer: `full` on each rank's tokens xf[r] (N, H) with their own
    capacity, as the ranks have; then backward of the loss both sides use. Returns the outputs per rank and
    (ep, ep) the kept assignments rank r sends to rank d (the experts of rank d are a contiguous block)."""
    ep = xf.shape[0]
    ys, kept = [], []
    for r in range(ep):
        ys.append(full(xf[r]))
        kept.append(
            full.stats["kept"].view(ep, -1).sum(1)
        )  # (ep,) kept assignments per destination
    (torch.stack(ys).square().sum() / xf.numel()).backward()
    return ys, torch.stack(kept)


def build_pair(
    hidden: int, heads: int, moe: MoE, grid: Grid
) -> tuple[CausalTransformer, CausalTransformer]:
    """The one-process model around `moe` and its EP copy: this rank keeps only its E/ep experts, the rest
    replicated."""
    full = moe_transformer(hidden, heads, moe)  # common.models' transformer, the MoE in its slot
    split = copy.deepcopy(full)
    ep = grid.size("ep")
    group = grid.group("ep") if ep > 1 else None
    set_moe(split, ExpertParallelMoE(moe, grid.coords["ep"], ep, group))
    return full, split


def param_gap(full: CausalTransformer, split: CausalTransformer) -> float:
    """max |split parameter - one-process parameter|, expert i of this rank against expert first + i."""
    first = moe_of(split).ep_rank * moe_of(split).local
    reference, gaps = dict(full.named_parameters()), []
    for name, p in split.named_parameters():
        if (
            EXPERTS in name
        ):  # "blocks.0.mlp.moe.experts.1.fc1.weight": local expert 1 = expert first + 1
            head, tail = name.split(EXPERTS)
            i, rest = tail.split(".", 1)
            name = f"{head}{EXPERTS}{first + int(i)}.{rest}"
        gaps.append(max_abs_diff(p, reference[name]))
    return nan_max(gaps)


def reduce_grads(split: CausalTransformer, grid: Grid) -> None:
    """Sum the gradients where copies live: experts over dp (one flat all-reduce), the rest over the world."""
    world = grid.size("dp") * grid.size("ep")
    experts = [p for n, p in split.named_parameters() if EXPERTS in n]
    rest = [p for n, p in split.named_parameters() if EXPERTS not in n]
    for params, group, size in ((experts, grid.group("dp"), grid.size("dp")), (rest, None, world)):
        if size == 1:
            continue  # nobody else holds a copy
        # One all-reduce carries the gradients and, last, whether backward reached each parameter on any rank:
        # where no rank's did (an expert no token chose), .grad stays None, as one process leaves it, so SGD's
        # momentum skips it there too. A zero gradient would still move an expert reached at an earlier step:
        # ep_dp_params_equal_one_process then measured 2.9e-5 at 4 processes with --experts 64 --top-k 1
        # --batch-size 1 (at the default batch every expert is reached at every step, and nothing shows).
        reached = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
        flat = torch.cat([grad_of(p).flatten() for p in params] + [reached])
        dist.all_reduce(flat, group=group)
        grads, reached = flat[: -len(params)], flat[-len(params) :].tolist()
        for p, g, hit in zip(params, grads.split([p.numel() for p in params]), reached):
            p.grad = g.view_as(p).clone() if hit else None


def balance_runs(
    seeds, weight, steps, experts, k, capacity_factor, hidden, heads, batch=8, lr=0.05
) -> tuple[dict, dict]:
    """Train the one-process MoE model with the balance loss at `weight` and without it (0.0), at each seed:
    returns {weight: [busiest expert / mean on held-out digits, per seed]} and {seed: histograms}."""
    tokens, test = digit_tokens(), digit_tokens(train=False)[:64]
    ratios, hists = {0.0: [], weight: []}, {}
    for seed in seeds:
        for w in ratios:
            set_seed(seed)
            model = moe_transformer(hidden, heads, MoE(hidden, experts, k, capacity_factor))
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
            g = torch.Generator().manual_seed(seed)
            hists.setdefault(seed, {"before": imbalance(model, test)[1]})
            for _ in range(steps):
                x = tokens[torch.randint(len(tokens), (batch,), generator=g)]
                loss = next_token_loss(model, x) + w * moe_of(model).stats["aux"]
                opt.zero_grad()
                loss.backward()
                opt.step()
            ratio, hists[seed][f"after, balance weight {w}"] = imbalance(model, test)
            ratios[w].append(ratio)
    return ratios, hists
