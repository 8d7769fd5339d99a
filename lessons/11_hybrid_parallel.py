"""Lesson 11: hybrid parallelism -- ranks on a grid: PP x DP, then FSDP x TP (and PP x DP x TP on 8 ranks).

Run it:

    python lessons/11_hybrid_parallel.py                                      # every mesh 1 x 1: one process
    torchrun --standalone --nproc_per_node=4 lessons/11_hybrid_parallel.py    # pp=2 x dp=2, then dp=2 x tp=2
    torchrun --standalone --nproc_per_node=2 lessons/11_hybrid_parallel.py    # pp=2 x dp=1, then dp=1 x tp=2
    torchrun --standalone --nproc_per_node=8 lessons/11_hybrid_parallel.py --dp-pp none --fsdp-tp none \\
        --dp-pp-tp 2x2x2                                                      # 3-D: pp=2 x dp=2 x tp=2

The model: the digits read as 8 rows (tokens) of 8 pixels, Linear(8 -> H), --layers MLP blocks, mean,
Linear(H -> 10) (`common.tensor_parallel.layers.digits_transformer`). Every combination trains it for --steps
SGD steps on a global batch of --batch-size images, and is compared with one process training the unsplit
model on that global batch.

The grid's order: pp outermost, then dp, then tp innermost (torchtitan's and Megatron-LM's order).
Consecutive ranks share the innermost group, and a GPU node holds consecutive ranks: so tp, which all-reduces
activations in every layer, stays on a node's fast links; pp, which only sends activations at stage
boundaries, spans nodes; dp's gradient all-reduce (or FSDP's all-gathers) sits between. --dp-pp 2x2 means
dp=2 and pp=2 whatever the order.

What to look for:
- PP x DP (`Grid(info, pp=2, dp=2)`): two pipeline replicas. Each dp rank takes its 1/dp of the global batch;
  activations and their gradients travel by send/recv inside the pp group (GPipe, --microbatches); each
  stage's gradients are averaged over its dp group only (one all-reduce of the stage's gradients, what DDP
  with `process_group=grid.group("dp")` does). The parameters equal one process on the global batch (<= 1e-5).
- FSDP x TP (`Grid(info, dp=2, tp=2)`, the 2-D layout of large-model training): `parallelize_module` on
  `grid.submesh("tp")`, then `fully_shard` on `grid.submesh("dp")`. Same claim. Each block and the root (embed
  and head) is one FSDP unit: each unit's parameters are all-gathered for forward, the blocks' again for
  backward, and the root's are not (FSDP2 keeps the root unsharded after forward: backward needs it at once),
  so L blocks cost L + 1 all-gathers forward and L backward; one reduce-scatter per unit. `fully_shard` also
  takes a 2-D mesh, (replicate, shard): HSDP, sharding inside a node and replicating across nodes; here the
  second dimension is tp's, so FSDP gets the 1-D dp sub-mesh.
- The rank grid and which collective travelled in which group during one step, counted while it ran
  (`count_collectives` for the hand-built parts, `count_dtensor_collectives` for DTensor's and FSDP2's).
- A decision table: which parallelism for which limit, with this run's bytes per step: the buffer handed to
  each collective and the bytes each rank sends under the ring model (not the same thing: an all-gather of a
  full buffer of N bytes sends (n-1)/n N per rank, an all-reduce 2 (n-1)/n N).
- Bad input: --dp-pp 3x2 on 4 ranks, more pipeline stages than --layers, a tp that does not divide --hidden:
  one line on every rank, exit 2.

Sources: Narayanan et al. 2021, Megatron-LM 3-D parallelism (https://arxiv.org/abs/2104.04473); the 2-D
tutorial https://pytorch.org/tutorials/intermediate/TP_tutorial.html; torchtitan's
`distributed/parallel_dims.py` for the grid's order;
https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html (reshard_after_forward, HSDP).
"""

from __future__ import annotations

import argparse
import copy
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from common.data import digits_split
from common.harness.env import DistInfo, LessonError, read_torchrun_env
from common.harness.grid import Grid
from common.harness.ranks import gather_to_rank0
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main, set_seed
from common.measure.counters import CollectiveCount, count_collectives
from common.measure.differences import max_over_ranks
from common.measure.dtensor_counts import count_dtensor_collectives
from common.tensor_parallel.layers import (
    check_tp_degree,
    digits_transformer,
    max_shard_diff,
    tensor_parallelize,
)

TOL = 1e-5
ORDER = ("pp", "dp", "tp")  # the grid's dimensions, outermost first


def _mesh(text: str, names: tuple, world_size: int) -> dict | None:
    """'2x2' -> {"dp": 2, "pp": 2}; 'none' -> None; 'auto' -> inner dimensions 2 when the world allows."""
    if text == "none":
        return None
    if text == "auto":  # 2-D: the second size 2 when the world is even; 3-D: 2x2x2 on 8 ranks only
        inner = 2 if world_size % 2 == 0 else 1
        sizes = (
            [world_size // inner, inner]
            if len(names) == 2
            else [2, 2, 2]
            if world_size == 8
            else None
        )
        if sizes is None:
            return None
    else:
        try:
            sizes = [int(t) for t in text.split("x")]
        except ValueError:
            raise LessonError(
                f"a mesh is sizes joined by x, like 2x2, or auto or none; got {text!r}"
            ) from None
    if len(sizes) != len(names):
        raise LessonError(f"mesh {text!r} needs {len(names)} sizes ({' x '.join(names)})")
    return dict(zip(names, sizes))


def build_grid(info: DistInfo, sizes: dict) -> Grid:
    """The grid of `sizes` ({"dp": 2, "pp": 2}) with its dimensions in ORDER: pp outermost, tp innermost."""
    return Grid(info, **{name: sizes[name] for name in ORDER if name in sizes})


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--dp-pp", default="auto", help="DP x PP sizes, e.g. 2x2; auto: (world/2) x 2; none: skip"
    )
    p.add_argument(
        "--fsdp-tp", default="auto", help="FSDP x TP sizes, e.g. 2x2; auto: (world/2) x 2"
    )
    p.add_argument(
        "--dp-pp-tp", default="auto", help="DP x PP x TP sizes, e.g. 2x2x2; auto: on 8 ranks"
    )
    p.add_argument(
        "--hidden", type=int, default=32, help="H, features per token; tp must divide it"
    )
    p.add_argument(
        "--layers", type=int, default=4, help="MLP blocks; at least one per pipeline stage"
    )
    p.add_argument(
        "--batch-size", type=int, default=16, help="global batch: images per step, all dp ranks"
    )
    p.add_argument(
        "--microbatches", type=int, default=2, help="micro-batches per pipeline step (GPipe)"
    )
    p.add_argument("--steps", type=int, default=3, help="training steps compared with one process")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--results", default=None, help="rank 0 writes the reported numbers here as JSON"
    )
    add_distributed_args(p)
    args = p.parse_args(argv)
    world_size = read_torchrun_env()[2]
    args.meshes = {
        "dp_pp": _mesh(args.dp_pp, ("dp", "pp"), world_size),
        "fsdp_tp": _mesh(args.fsdp_tp, ("dp", "tp"), world_size),
        "dp_pp_tp": _mesh(args.dp_pp_tp, ("dp", "pp", "tp"), world_size),
    }
    if (
        min(args.hidden, args.layers, args.batch_size, args.microbatches, args.steps) < 1
        or args.lr <= 0
    ):
        raise LessonError(
            "--hidden, --layers, --batch-size, --microbatches and --steps must be >= 1, --lr > 0"
        )
    for sizes in filter(None, args.meshes.values()):
        check_mesh(sizes, args, world_size)
    return args


def check_mesh(sizes: dict, args: argparse.Namespace, world_size: int) -> None:
    """Raise LessonError (on every rank, before any process group) for a mesh this run cannot use."""
    build_grid(DistInfo(world_size=world_size), sizes)  # Grid's own check of the product
    if sizes.get("pp", 1) > args.layers:
        raise LessonError(
            f"{sizes['pp']} pipeline stages but only {args.layers} layers (--layers): "
            f"every stage needs at least one"
        )
    check_tp_degree(sizes.get("tp", 1), args.hidden)
    if args.batch_size % (sizes["dp"] * args.microbatches):
        raise LessonError(
            f"--batch-size {args.batch_size} must split into dp={sizes['dp']} x "
            f"{args.microbatches} micro-batches"
        )


# ---- the pipeline by hand (lesson 09), its gradients averaged over dp ----------------------------------


def stage_of(model: nn.Sequential, grid: Grid) -> nn.Sequential:
    """This pp_rank's slice of [embed, blocks..., mean, head]: the blocks split as evenly as they go; the
    first stage also embeds, the last also pools and classifies. Slices keep the whole model's parameter
    names."""
    blocks = (
        torch.arange(1, len(model) - 2).tensor_split(grid.size("pp"))[grid.coords["pp"]].tolist()
    )
    start = 0 if grid.is_first("pp") else blocks[0]
    return model[start : len(model) if grid.is_last("pp") else blocks[-1] + 1]


def p2p(op: str, t: torch.Tensor, peer: int, grid: Grid, counts: CollectiveCount) -> None:
    """Send `t` to (or receive it from) global rank `peer` of this rank's pp group, and count it there."""
    group = grid.group("pp")
    (dist.send if op == "send" else dist.recv)(t, peer, group=group)
    key = (
        op,
        tuple(dist.get_process_group_ranks(group)) if group is not None else (grid.info.rank,),
    )
    counts.calls[op] = counts.calls.get(op, 0) + 1
    counts.bytes[op] = counts.bytes.get(op, 0) + t.numel() * t.element_size()
    counts.groups[key] = counts.groups.get(key, 0) + 1


def pipeline_step(
    stage: nn.Module, grid: Grid, x, y, m: int, hidden: int, counts: CollectiveCount
) -> None:
    """One GPipe step on this dp rank's batch: all m forwards, then all m backwards (lesson 09's schedule)."""
    pp, me = grid.ranks_in("pp"), grid.coords["pp"]
    held = []  # (input, output) per micro-batch, kept for backward
    for xm, ym in zip(x.chunk(m), y.chunk(m)):
        h = xm  # (b, 8, 8) on the first stage
        if not grid.is_first("pp"):
            h = torch.empty(
                len(xm), xm.shape[1], hidden, device=xm.device
            )  # (b, S, H) from the stage before
            p2p("recv", h, pp[me - 1], grid, counts)
            h.requires_grad_()
        out = stage(h)
        if grid.is_last("pp"):
            out = F.cross_entropy(out, ym) / m  # the mean over this dp rank's batch, in m parts
        else:
            p2p("send", out.detach(), pp[me + 1], grid, counts)
        held.append((h, out))
    for h, out in reversed(held):
        if grid.is_last("pp"):
            out.backward()
        else:
            grad = torch.empty_like(out)
            p2p("recv", grad, pp[me + 1], grid, counts)
            out.backward(grad)
        if not grid.is_first("pp"):
            p2p("send", h.grad, pp[me - 1], grid, counts)


def average_over_dp(stage: nn.Module, grid: Grid) -> None:
    """Average the stage's gradients over its dp group: one all-reduce of all of them (one DDP bucket)."""
    if grid.size("dp") == 1:
        return
    grads = [p.grad for p in stage.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=grid.group("dp"))
    flat /= grid.size("dp")
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


# ---- what travelled where, in bytes handed over and bytes sent -----------------------------------------


def sent_per_rank(op: str, n: int, nbytes: int) -> int:
    """Bytes one rank sends for `nbytes` handed to `op` in a group of n, under the ring model: an all-reduce
    sends 2 (n-1)/n of its buffer, an all-gather or reduce-scatter (n-1)/n of the full buffer, send all of it,
    recv nothing."""
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "send": 1.0,
        "recv": 0.0,
    }[op]
    return round(factor * nbytes)


def dims_of(counts: CollectiveCount, dim_of_op: dict, grid: Grid) -> list[dict]:
    """Rows {op, dim, ranks, calls, bytes, sent} of one step's counts, and whether each group is the grid's
    `dim`. A row's ranks come from the process group the call really used."""
    return [
        {
            "op": op,
            "dim": dim_of_op[op],
            "ranks": list(ranks),
            "calls": n,
            "bytes": counts.bytes[op],
            "sent": sent_per_rank(op, len(ranks), counts.bytes[op]),
            "in_its_group": list(ranks) == grid.ranks_in(dim_of_op[op]),
        }
        for (op, ranks), n in sorted(counts.groups.items())
    ]


def show_groups(report: Report, name: str, grid: Grid, rows: list[dict], info) -> list[dict]:
    """Rank 0 prints the grid and every (collective, group) seen in the step, from all ranks' counts."""
    everyone = gather_to_rank0(rows, info) or []
    seen = {(r["op"], tuple(r["ranks"])): r for rank_rows in everyone for r in rank_rows}
    table = [seen[k] for k in sorted(seen)]
    lines = [
        f"  {r['op']:>14} in the {r['dim']} group {r['ranks']}: {r['calls']} calls, buffer {r['bytes']} "
        f"bytes, sent {r['sent']} bytes per rank"
        for r in table
    ]
    report.value(
        f"{name}_groups", table, "\n".join(["  " + line for line in grid.describe()] + lines)
    )
    # Only a collective's group can be misplaced: a send to the wrong peer would hang or break the equality
    # above, so send/recv are shown, not checked. With one group per dimension nothing can be misplaced.
    checked = [r for r in rows if r["op"] not in ("send", "recv")]
    if any(grid.size(r["dim"]) < info.world_size for r in checked):
        misplaced = max_over_ranks(sum(not r["in_its_group"] for r in checked))
        report.claim(
            f"{name}_collectives_in_their_groups",
            misplaced,
            "==",
            0,
            "  collectives seen outside the group of their dimension: {value:g}",
        )
    return table


# ---- the combinations ----------------------------------------------------------------------------------


def dp_pp(report, info, sizes: dict, model0, data, ref, args) -> list[dict]:
    """PP x DP (x TP): pipeline stages by hand, gradients averaged over dp, tp split by hand."""
    grid = build_grid(info, sizes)
    name = "_".join(sizes)
    stage = stage_of(copy.deepcopy(model0), grid)  # a slice shares its modules: copy first
    tp_rank = grid.coords.get("tp", 0)
    if "tp" in sizes:
        stage = tensor_parallelize(stage, tp_rank, grid.size("tp"), grid.group("tp"))
    opt = torch.optim.SGD(stage.parameters(), lr=args.lr)
    dp_size, dp_rank = grid.size("dp"), grid.coords["dp"]
    for x, y in data:
        x, y = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
        opt.zero_grad()
        with count_collectives() as step:  # the last step's counts are the picture
            pipeline_step(stage, grid, x, y, args.microbatches, args.hidden, step)
        with count_collectives() as grads:
            average_over_dp(stage, grid)
        opt.step()
    diff = max_over_ranks(max_shard_diff(ref, stage, tp_rank))  # NaN-safe: a diverged run fails
    shape = " x ".join(f"{k}={v}" for k, v in grid.sizes.items())
    report.claim(
        f"{name}_equals_one_process",
        diff,
        "<=",
        TOL,
        f"{shape}: after {args.steps} steps, max |parameter - one process on the global batch| = "
        "{value:.1e}",
    )
    rows = dims_of(step, {"send": "pp", "recv": "pp", "all_reduce": "tp"}, grid)
    return show_groups(report, name, grid, rows + dims_of(grads, {"all_reduce": "dp"}, grid), info)


def shard_fsdp_tp(model: nn.Sequential, grid: Grid) -> int:
    """parallelize_module on each block's MLP over tp, then fully_shard each block and the root over dp;
    returns the number of FSDP units."""
    for block in model[1:-2]:
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        parallelize_module(block.mlp, grid.submesh("tp"), plan)
        fully_shard(
            block, mesh=grid.submesh("dp")
        )  # each block's (tp-local) parameters: 1/dp per rank
    fully_shard(
        model, mesh=grid.submesh("dp")
    )  # the root: embed and head, and the group of all units
    return len(model[1:-2]) + 1


def fsdp_tp(report, info, sizes: dict, model0, data, ref, args) -> list[dict]:
    """FSDP x TP: parallelize_module on the tp sub-mesh, then fully_shard on the dp sub-mesh."""
    grid = build_grid(info, sizes)
    model = copy.deepcopy(model0)
    units = (
        shard_fsdp_tp(model, grid) if grid.mesh is not None else 0
    )  # plain python: nothing to shard
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    dp_size, dp_rank = grid.size("dp"), grid.coords["dp"]
    for x, y in data:
        x, y = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
        opt.zero_grad()
        with count_dtensor_collectives() as fwd:
            loss = F.cross_entropy(model(x), y)
        with count_dtensor_collectives() as bwd:
            loss.backward()  # fully_shard reduce-scatters gradients averaged over dp
        opt.step()
    # DTensor parameters are gathered whole to compare (full_tensor logs that a (dp, tp) shard takes 2)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    diff = max_over_ranks(max_shard_diff(ref, model, 0))
    report.claim(
        "fsdp_tp_equals_one_process",
        diff,
        "<=",
        TOL,
        f"fsdp: dp={sizes['dp']} x tp={sizes['tp']}: after {args.steps} steps, max |parameter - one "
        "process on the global batch| = {value:.1e}",
    )
    if (
        units and grid.size("dp") > 1
    ):  # with dp = 1 every rank holds everything: FSDP gathers nothing
        report.claim(
            "fsdp_tp_forward_all_gathers",
            fwd.calls.get("all_gather", 0),
            "==",
            units,
            f"  {units} FSDP units ({units - 1} blocks + the root): all-gathers in forward "
            "{value}",
        )
        report.claim(
            "fsdp_tp_backward_all_gathers",
            bwd.calls.get("all_gather", 0),
            "==",
            units - 1,
            "  all-gathers in backward {value}: the root stays unsharded after forward "
            "(reshard_after_forward is False for it by default), so backward does not gather it "
            "again",
        )
    step = CollectiveCount()
    for c in (fwd, bwd):
        for k, v in c.groups.items():
            step.groups[k] = step.groups.get(k, 0) + v
        for k, v in c.bytes.items():
            step.bytes[k] = step.bytes.get(k, 0) + v
    dims = {"all_gather": "dp", "reduce_scatter": "dp", "all_reduce": "tp"}
    return show_groups(report, "fsdp_tp", grid, dims_of(step, dims, grid), info)


def decision_table(report: Report, tables: dict, model0: nn.Module, args) -> None:
    """Which parallelism for which limit, with the busiest rank's bytes per step from this run's counts."""
    params = sum(p.numel() for p in model0.parameters())
    rows = [
        (
            "dp",
            "dp",
            "all_reduce",
            "the model fits on a rank: replicas; gradients all-reduced once a step{stage}",
        ),
        (
            "fsdp",
            "dp",
            "all_gather",
            "the model does not fit: parameters gathered for forward, and for "
            "backward (not the root's)",
        ),
        (
            "fsdp",
            "dp",
            "reduce_scatter",
            "  ... and gradients reduce-scattered, each rank keeps 1/dp",
        ),
        (
            "tp",
            "tp",
            "all_reduce",
            "a layer is too big, or the per-rank batch already small: activations "
            "all-reduced once forward and once backward per MLP or attention sub-block (a layer with both "
            "pays 2 + 2), so fast links (inside a node)",
        ),
        (
            "pp",
            "pp",
            "send",
            "many layers, slow links (across nodes: pp is the outermost grid "
            "dimension): activations at stage boundaries only, at the cost of a bubble",
        ),
    ]
    lines = [
        f"decision table for H={args.hidden}, {args.layers} layers ({params} parameters, {4 * params} "
        f"bytes), global batch {args.batch_size} x 8 tokens; per step, busiest rank: the buffer handed "
        "to the collective, and the bytes it sends (ring model):"
    ]
    table = []
    for (
        kind,
        dim,
        op,
        when,
    ) in rows:  # FSDP's rows come from FSDP x TP, DP's from the hand-built runs
        runs = (
            ["fsdp_tp"]
            if kind == "fsdp"
            else ["dp_pp", "dp_pp_tp"]
            if kind == "dp"
            else list(tables)
        )
        found = [
            (run, r)
            for run in runs
            for r in tables.get(run, [])
            if (r["op"], r["dim"]) == (op, dim)
        ]
        if found:
            run, busiest = max(found, key=lambda f: f[1]["sent"])
            pp, tp = (
                args.meshes[run].get("pp", 1),
                args.meshes[run].get("tp", 1),
            )  # dp's runs have a pp dim
            split = f" split over tp = {tp}" if tp > 1 else ""
            stage = (
                (
                    f" (here replicas of one pipeline stage{split}, pp = {pp}: the buffer is its gradients, "
                    f"not the model's {4 * params:,} bytes)"
                )
                if pp > 1
                else ""
            )
            when = when.format(stage=stage)
            table.append(
                {
                    "parallelism": kind,
                    "op": op,
                    "bytes": busiest["bytes"],
                    "sent": busiest["sent"],
                    "when": when,
                }
            )
            lines.append(
                f"  {kind:>4} {op:>14}: buffer {busiest['bytes']:>7}, "
                f"sent {busiest['sent']:>7} bytes  {when}"
            )
    report.value("decision_table", table, "\n".join(lines))


def digits_batches(args, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """--steps global batches of the digits, the same on every rank: x (B, 8, 8), y (B,)."""
    images, labels = digits_split()[0].tensors
    g = torch.Generator().manual_seed(args.seed)
    picks = [torch.randint(len(labels), (args.batch_size,), generator=g) for _ in range(args.steps)]
    return [(images[i].squeeze(1).to(device), labels[i].to(device)) for i in picks]


def one_process(model0: nn.Module, data, lr: float) -> nn.Module:
    """The reference: the unsplit model trained by one process on each global batch."""
    ref = copy.deepcopy(model0)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    return ref


def main(argv=None) -> None:
    args = parse_args(argv)
    with distributed_session(args) as info:
        report = Report(info)
        set_seed(args.seed)
        # the same init on every rank (same seed)
        model0 = digits_transformer(args.hidden, 0, args.layers).to(info.device)
        data = digits_batches(args, info.device)
        ref = one_process(model0, data, args.lr)  # what every combination must equal
        tables = {}
        for name, run in (("dp_pp", dp_pp), ("fsdp_tp", fsdp_tp), ("dp_pp_tp", dp_pp)):
            if args.meshes[name] is not None:
                tables[name] = run(report, info, args.meshes[name], model0, data, ref, args)
        decision_table(report, tables, model0, args)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
