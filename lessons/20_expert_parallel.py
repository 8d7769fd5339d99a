"""Lesson 20: expert parallelism -- a mixture of experts whose tokens travel by all-to-all, = one process.

Run it:

    python lessons/20_expert_parallel.py                                      # ep = 1: every expert here
    torchrun --standalone --nproc_per_node=2 lessons/20_expert_parallel.py    # ep = 2
    torchrun --standalone --nproc_per_node=4 lessons/20_expert_parallel.py    # ep = 4, then dp 2 x ep 2

The model: lessons 19-21's causal transformer (common/models.py, one block) predicting the next of 64 pixel
tokens of a digit, with E experts in its MLP slot (common/expert_parallel/). Each rank has its own tokens.

What to look for:
- Routing, counted: the router's top-k choice per token, the histogram of tokens per expert, the capacity
  C = ceil(capacity_factor * N * k / E) (the kept counts are min(count, C), with C computed here: at the
  default N = 63, cf N k / E = 31.5, so a floor would show) and the assignments it drops (counted exactly).
  A token whose every choice is dropped gets exactly 0 from the layer: the residual x + 0 carries it.
- Expert parallelism by hand: rank r holds experts r*E/ep ... (r+1)*E/ep - 1. Per layer: one all_to_all_single
  of the split sizes (how many rows each rank will receive), one of the token rows (dispatch), one of their
  expert ids, the local experts, one back (combine); backward: the same calls with the splits swapped
  (common.expert_parallel.moe.AllToAll: ours rather than torch.distributed.nn.functional.all_to_all_single,
  deprecated in 2.13, which gives the same rows and gradients, checked). Output, input gradient, expert and
  router gradients equal the same MoE in one process; the rows each rank sends to each other rank equal the
  routing histogram exactly; the bytes counted at the calls equal the formula; training follows one process.
- EP x DP (4 ranks: dp 2 x ep 2): the experts' gradients are all-reduced in the dp group only, everything
  else in the whole world (why: common/expert_parallel/training.py).
- Load: the busiest rank's rows against the mean; the Switch Transformer's balance loss and the histogram.

Sources: Shazeer et al. 2017 (https://arxiv.org/abs/1701.06538); GShard, Lepikhin et al. 2020
(https://arxiv.org/abs/2006.16668); Switch Transformer, Fedus et al. 2021 (https://arxiv.org/abs/2101.03961);
https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_to_all_single; torchtitan's
`distributed/expert_parallel.py` for a GPU version.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch
import torch.distributed as dist

from common.expert_parallel.model import (
    digit_tokens,
    moe_of,
    next_token_loss,
)
from common.expert_parallel.moe import (
    ExpertParallelMoE,
    MoE,
    all_to_all_traffic,
    all_to_all_vs_torch,
    check_moe_options,
    kept_choices_only,
)
from common.expert_parallel.training import (
    balance_runs,
    build_pair,
    expert_grads,
    one_process_layer,
    param_gap,
    reduce_grads,
)
from common.harness.env import DistInfo, LessonError, read_torchrun_env
from common.harness.grid import Grid
from common.harness.ranks import all_reduce_sum, print0
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main, set_seed
from common.measure.counters import count_collectives
from common.measure.differences import max_abs_diff, max_over_ranks, nan_max

TOL = 1e-5
FEATURE_CALLS = ("dispatch", "combine", "dispatch backward", "combine backward")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=4, help="E; the world size must divide it")
    p.add_argument("--top-k", type=int, default=2, help="experts per token, 1 <= k <= E")
    p.add_argument("--capacity-factor", type=float, default=1.0, help="C = ceil(cf N k / E)")
    p.add_argument("--hidden", type=int, default=32, help="H, features per token, >= 8")
    p.add_argument("--heads", type=int, default=4, help="attention heads, dividing H (default 4)")
    p.add_argument(
        "--tokens",
        type=int,
        default=63,
        help="N, tokens per rank in the layer test (default 63: "
        "odd, so cf N k / E = 31.5 is not whole and C's rounding shows)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="sequences PER RANK per step")
    p.add_argument("--steps", type=int, default=30, help="training steps (default %(default)s)")
    p.add_argument("--aux-weight", type=float, default=0.01, help="balance loss weight, in [0, 1]")
    p.add_argument("--lr", type=float, default=0.05, help="SGD, momentum 0.9: in [0.01, 0.1]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", default=None, help="rank 0 writes its numbers here as JSON")
    add_distributed_args(p)
    # This lesson's tensors live on the CPU (tiny experts: the all-to-all's routing is the point), so it runs
    # with gloo on the CPU even where GPUs are (NCCL would need every tensor on cuda:LOCAL_RANK).
    p.set_defaults(backend="gloo", device="cpu")
    args = p.parse_args(argv)
    if args.backend != "gloo" or args.device != "cpu":
        raise LessonError(
            "lesson 20 runs on the CPU with gloo (--backend gloo --device cpu, the defaults)"
        )
    # validated before any process group: every rank fails alike, none waits
    if min(args.heads, args.tokens, args.batch_size) < 1 or args.steps < 10 or args.hidden < 8:
        raise LessonError(
            "--heads, --tokens and --batch-size must be >= 1, --hidden >= 8 and --steps >= 10"
        )
    # measured: this tiny model's test loss falls >= 20% in 10 steps at 0.01
    if not 0.01 <= args.lr <= 0.1:
        raise LessonError(f"--lr must be in [0.01, 0.1], where this model trains, got {args.lr}")
    if args.hidden % args.heads or not 0 <= args.aux_weight <= 1:  # 1e6 at lr 0.1 diverged to NaN
        raise LessonError("--heads must divide --hidden and --aux-weight must be in [0, 1]")
    try:
        check_moe_options(args.experts, args.top_k, args.capacity_factor, ep=read_torchrun_env()[2])
    except ValueError as e:
        raise LessonError(str(e)) from None
    return args


@dataclasses.dataclass
class Run:
    """What the sections share: options, rank, report, the grid (in section 4 a copy with the 2 x 2 mesh)."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    grid: Grid


def routing(run: Run) -> None:
    """Section 1 (one process, the same on every rank): top-k, the histogram, capacity and the drops."""
    set_seed(run.args.seed)
    moe = MoE(run.args.hidden, run.args.experts, run.args.top_k, run.args.capacity_factor)
    x = torch.randn(run.args.tokens, run.args.hidden)  # (N, H)
    y = moe(x)
    s = moe.stats
    run.report.value(
        "histogram",
        s["counts"].tolist(),
        "routing {a.tokens} tokens, top-{a.top_k} of {a.experts} experts: assignments per expert "
        "{value}, capacity C = {cap}",
        a=run.args,
        cap=s["cap"],
    )
    # C before rounding
    exact = run.args.capacity_factor * run.args.tokens * run.args.top_k / run.args.experts
    # computed here, not by common.expert_parallel.moe.capacity, which the layer and its reference share
    cap = math.ceil(exact)
    # counted from the keep mask
    kept = torch.bincount(s["idx"][s["keep"]], minlength=run.args.experts)
    run.report.claim(
        "kept_equals_min_count_capacity",
        max_abs_diff(kept, s["counts"].clamp(max=cap)),
        "==",
        0,
        "  kept per expert {kept} = min(count, ceil(cf N k / E) = ceil({exact:g}) = {cap}): "
        "max |diff| {value}",
        kept=kept.tolist(),
        exact=exact,
        cap=cap,
    )
    run.report.claim(
        "dropped_counted_exactly",
        s["dropped"],
        "==",
        int((s["counts"] - s["cap"]).clamp(min=0).sum()),  # the overflow
        "  assignments dropped (not kept by the mask): {value} = sum over experts of "
        "max(0, count - C)",
    )
    dropped(run, moe, x, y)


def dropped(run: Run, moe: MoE, x: torch.Tensor, y) -> None:
    """A dropped choice adds nothing; a token whose every choice was dropped gets its residual."""
    s = moe.stats
    if s["dropped"]:
        run.report.claim(
            "dropped_choices_add_nothing",
            max_abs_diff(y, kept_choices_only(moe, x, s["keep"], run.args.top_k)),
            "<=",
            TOL,
            "  {lost} tokens lost a choice; max |layer output - sum over the kept choices only| = "
            "{value:.1e}\n  (a dropped choice adds 0: the weights are not renormalized)",
            lost=int((~s["keep"]).any(-1).sum()),
        )
    gone = ~s["keep"].any(-1)  # tokens with every choice dropped
    run.report.value(
        "tokens_fully_dropped", int(gone.sum()), "  tokens whose every choice was dropped: {value}"
    )
    if gone.any():
        block_out = x + y  # the block's residual: x + moe(x)
        run.report.claim(
            "dropped_token_passes_through",
            max_abs_diff(block_out[gone], x[gone]),
            "==",
            0,
            "  for those, |x + moe(x) - x| = {value}: the layer gives 0, the residual carries the "
            "token",
        )


def layer_vs_one_process(run: Run) -> None:
    """Section 2: the MoE layer with experts over the ep ranks vs the same MoE in one process, fwd and bwd."""
    ep, ep_rank, group = run.grid.size("ep"), run.grid.coords["ep"], run.grid.group("ep")
    set_seed(run.args.seed)
    full = MoE(run.args.hidden, run.args.experts, run.args.top_k, run.args.capacity_factor)
    split = ExpertParallelMoE(full, ep_rank, ep, group if ep > 1 else None)
    X = torch.randn(ep, run.args.tokens, run.args.hidden)  # every rank's tokens; rank r owns X[r]
    xf = X.clone().requires_grad_()
    ys, want = one_process_layer(full, xf)  # want[r, d]: the rows rank r should send rank d
    xs = X[ep_rank].clone().requires_grad_()
    with count_collectives() as fwd, all_to_all_traffic() as traffic:
        y = split(xs)
    with count_collectives() as bwd, all_to_all_traffic() as traffic_back:
        (y.square().sum() / X.numel()).backward()
    if ep > 1:  # the router is replicated: each rank holds its own tokens' part of the gradient
        dist.all_reduce(split.router.weight.grad, group=group)
    gaps = [
        max_abs_diff(y, ys[ep_rank]),
        max_abs_diff(xs.grad, xf.grad[ep_rank]),
        expert_grads(full, split),
        max_abs_diff(split.router.weight.grad, full.router.weight.grad),
    ]
    run.report.claim(
        "layer_equals_one_process",
        max_over_ranks(nan_max(gaps)),
        "<=",
        TOL,
        "ep={ep}: max |EP - one process| over output, input, expert and router gradients = "
        "{value:.1e}",
        ep=ep,
    )
    rows_sent(run, split, want)
    calls = (fwd.calls.get("all_to_all_single", 0), bwd.calls.get("all_to_all_single", 0))
    run.report.claim(
        "all_to_alls_forward_backward",
        int(calls == ((4, 2) if ep > 1 else (0, 0))),
        "==",
        1,
        "  all_to_all_single calls: forward {calls[0]} (split sizes, rows, expert ids, combine),\n"
        "  backward {calls[1]} (combine and dispatch, splits swapped): {value}",
        calls=calls,
    )
    moved = sum(b for what, _, b, _ in traffic + traffic_back if what in FEATURE_CALLS)
    formula = 4 * (want.sum() - want.trace()).item() * run.args.hidden * xs.element_size()
    run.report.claim(
        "bytes_equal_formula",
        all_reduce_sum([moved], run.info)[0],
        "==",
        formula,
        "  feature bytes sent to other ranks, counted at the calls: {value:.0f}\n"
        "  = 4 (dispatch, combine, and both backward) x rows that leave their rank x H x 4",
    )
    rows_in = want.sum(0).double()  # rows each rank's experts process
    run.report.value(
        "busiest_rank_over_mean",
        (rows_in.max() / rows_in.mean()).item(),
        "  load: the busiest rank's rows / the mean = {value:.3f} (1.0 = balanced)",
    )


def rows_sent(run: Run, split: ExpertParallelMoE, want: torch.Tensor) -> None:
    """The split sizes each rank really passed to all_to_all_single, gathered, against the routing histogram
    of the one-process MoE; and where every token's choices went (recorded for the notebook's picture)."""
    ep, group = run.grid.size("ep"), run.grid.group("ep")
    sent = [split.stats["send"].clone() for _ in range(ep)]
    if ep > 1:
        dist.all_gather(sent, split.stats["send"], group=group)
    sent = torch.stack(sent)  # (ep, ep)
    # (N, k): the destination rank of each choice, -1 where it was dropped
    dest = torch.where(split.stats["keep"], split.stats["idx"] // split.local, -1)
    every = [dest.clone() for _ in range(ep)]
    if ep > 1:
        dist.all_gather(every, dest, group=group)
    run.report.record("destinations", torch.stack(every).tolist())  # [rank][token][choice]
    text = "  rows sent, rank (row) -> rank (column): {value}"
    run.report.value("rows_sent", sent.tolist(), text)
    run.report.claim(
        "rows_sent_equal_histogram",
        max_abs_diff(sent.double(), want.double()),
        "==",
        0,
        "  max |rows sent - routing histogram of the one-process MoE| = {value}",
    )


def against_torch(run: Run) -> None:
    """Our AllToAll vs torch.distributed.nn.functional.all_to_all_single: the same rows and gradients."""
    ep, ep_rank, group = run.grid.size("ep"), run.grid.coords["ep"], run.grid.group("ep")
    gap = all_to_all_vs_torch(group, ep_rank, ep, run.args.hidden)
    run.report.claim(
        "torch_all_to_all_agrees",
        max_over_ranks(gap),
        "==",
        0,
        "  torch.distributed.nn.functional.all_to_all_single: the same rows and input gradients "
        "(max |difference| {value})\n  we keep our 10 lines: it is deprecated in torch 2.13, "
        "our backward is in plain sight,\n  and the counters see our calls",
    )


def train(run: Run, tag: str, steps: int) -> None:
    """Sections 3 and 4: train the EP model on this rank's sequences and the one-process model on every rank's
    (each with its own capacity, as the ranks have); losses and parameters compared."""
    dp, ep = run.grid.size("dp"), run.grid.size("ep")
    world = dp * ep
    me = run.grid.coords["dp"] * ep + run.grid.coords["ep"]  # my chunk of the global batch
    set_seed(run.args.seed)
    moe = MoE(run.args.hidden, run.args.experts, run.args.top_k, run.args.capacity_factor)
    full, split = build_pair(run.args.hidden, run.args.heads, moe, run.grid)
    opts = [torch.optim.SGD(m.parameters(), lr=run.args.lr, momentum=0.9) for m in (full, split)]
    tokens, test = digit_tokens(), digit_tokens(train=False)[:64]  # (1438, 64), (64, 64)
    g = torch.Generator().manual_seed(run.args.seed)  # the same global batch on every rank
    gaps = []
    # every rank evaluates the same held-out digits (the all-to-alls need every rank)
    with torch.no_grad():
        test_before = next_token_loss(split, test).item()
    for _step in range(steps):
        batch = tokens[torch.randint(len(tokens), (world * run.args.batch_size,), generator=g)]
        batch = batch.view(
            world, run.args.batch_size, -1
        )  # (world, B, 64): rank r trains on batch[r]
        losses = [
            next_token_loss(full, b) + run.args.aux_weight * moe_of(full).stats["aux"]
            for b in batch
        ]
        ref = sum(losses) / world
        loss = next_token_loss(split, batch[me]) + run.args.aux_weight * moe_of(split).stats["aux"]
        for model, opt, objective in ((full, opts[0], ref), (split, opts[1], loss / world)):
            opt.zero_grad()
            objective.backward()  # the EP loss is divided by world: the all-reduced sum is the global mean
            if model is split:
                with count_collectives() as reduced:
                    reduce_grads(split, run.grid)
            opt.step()
        gaps.append(abs(all_reduce_sum([loss.item() / world], run.info)[0] - ref.item()))
    run.report.claim(
        f"{tag}_training_equals_one_process",
        max_over_ranks(nan_max(gaps)),
        "<=",
        TOL,
        "{tag}: {steps} SGD steps, max |global loss - one-process loss| = {value:.1e}",
        tag=tag,
        steps=steps,
    )
    run.report.claim(
        f"{tag}_params_equal_one_process",
        max_over_ranks(param_gap(full, split)),
        "<=",
        TOL,
        "  max |parameter - one-process parameter| after training = {value:.1e}",
    )
    with torch.no_grad():
        after = next_token_loss(split, test).item()
    held_out_loss(run, tag, steps, test_before, after)
    gradient_reductions(run, tag, reduced)


def held_out_loss(run: Run, tag: str, steps: int, before: float, after: float) -> None:
    """The EP model's held-out loss after training over before: a claim from 30 steps on, else a value."""
    text = (
        "  held-out next-pixel loss of the EP model {before:.3f} -> {after:.3f}: ratio {value:.2f}"
    )
    # measured: 0.65-0.77 at the smallest settings (H = 8, lr 0.01, B = 1), 0.93 at 10 steps
    if steps >= 30:
        run.report.claim(
            f"{tag}_test_loss_falls", after / before, "<=", 0.9, text, before=before, after=after
        )
    else:
        run.report.value(f"{tag}_test_loss_ratio", after / before, text, before=before, after=after)


def gradient_reductions(run: Run, tag: str, reduced) -> None:
    """The all-reduces of one step's gradients, by group: experts in dp, the rest in the world, none in ep."""
    dp, world = run.grid.size("dp"), run.grid.size("dp") * run.grid.size("ep")
    expected = {
        ("all_reduce", tuple(run.grid.ranks_in("dp"))): int(dp > 1),
        ("all_reduce", tuple(range(world))): int(world > 1),
    }
    expected = {k: v for k, v in expected.items() if v}
    run.report.claim(
        f"{tag}_gradient_reductions",
        int(reduced.groups == expected),
        "==",
        1,
        "  gradient all-reduces per step: experts in dp {dp_ranks} {in_dp}, the rest in the world "
        "{in_world}, in ep 0: {value}",
        dp_ranks=run.grid.ranks_in("dp"),
        in_dp=int(dp > 1),
        in_world=int(world > 1),
    )


BALANCE = dict(
    seeds=(0, 1, 2), weight=0.1, steps=30, experts=4, k=2, capacity_factor=1.0, hidden=32, heads=4
)


def balance(run: Run) -> None:
    """Section 5 (one process, fixed settings: no option changes them, so its claim holds or fails for the
    code, never for an option): the Switch balance loss, trained with and without it on a few seeds."""
    b = BALANCE
    ratios, hists = balance_runs(**b)
    run.report.record("balance_histograms", {str(k): v for k, v in hists.items()})
    rounded = {str(k): [round(r, 3) for r in v] for k, v in ratios.items()}
    run.report.value(
        "balance_imbalance",
        rounded,
        "balance loss, {steps} steps x {seeds} seeds: busiest expert / mean on held-out digits\n"
        "  {value}\n  (before training, seed 0: {before})",
        steps=b["steps"],
        seeds=len(b["seeds"]),
        before=hists[b["seeds"][0]]["before"],
    )
    better = sum(with_ < without for with_, without in zip(ratios[b["weight"]], ratios[0.0]))
    run.report.claim(
        "balance_loss_evens_the_histogram",
        better,
        "==",
        len(b["seeds"]),
        "  seeds where weight {weight} left the busiest expert nearer the mean (fixed; no "
        "option reaches it): {value}",
        weight=b["weight"],
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    with distributed_session(args) as info:
        run = Run(args, info, Report(info), Grid(info, dp=1, ep=info.world_size))
        run.report.value("grid", run.grid.describe(), "\n".join(run.grid.describe()))
        routing(run)  # 1. top-k, capacity, drops
        layer_vs_one_process(run)  # 2. the layer over ep ranks
        if run.grid.size("ep") > 1:
            against_torch(run)
        train(run, "ep", args.steps)  # 3. training with ep
        if info.world_size == 4:  # 4. ep x dp
            mesh = Grid(info, dp=2, ep=2)
            run.report.value("grid_2d", mesh.describe(), "\n".join(mesh.describe()))
            train(dataclasses.replace(run, grid=mesh), "ep_dp", 10)
        else:
            print0("dp x ep: launch 4 processes for the 2 x 2 mesh")
        balance(run)  # 5. the balance loss
        run.report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
