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
  full buffer of N bytes sends (n-1)/n N per rank, an all-reduce 2 (n-1)/n N: measure/group_traffic.py).
  With pp > 1 the dp row's buffer is one stage's gradients, not the model's; tp pays one all-reduce forward
  and one backward per MLP or attention sub-block (a layer with both pays 2 + 2): tp wants a node's links.
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
from dataclasses import dataclass

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
from common.measure.counters import count_collectives
from common.measure.differences import max_over_ranks
from common.measure.dtensor_counts import count_dtensor_collectives
from common.measure.group_traffic import merged, traffic_rows
from common.tensor_parallel.layers import (
    check_tp_degree,
    digits_transformer,
    max_shard_diff,
    tensor_parallelize,
)

TOL = 1e-5
ORDER = ("pp", "dp", "tp")  # the grid's dimensions, outermost first


@dataclass
class Run:
    """What the combinations share: options, rank, report, the model all ranks start from, the global
    batches [(x (B, 8, 8), y (B,))] and `ref`, trained on them in one process: what all must equal."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    model0: nn.Module
    data: list
    ref: nn.Module


def _mesh(text: str, names: tuple, world_size: int) -> dict | None:
    """'2x2' -> {"dp": 2, "pp": 2}; 'none' -> None; 'auto' -> inner dimensions 2 when the world allows."""
    if text == "none":
        return None
    if text == "auto":  # 2-D: the second size 2 when the world is even; 3-D: 2x2x2 on 8 ranks only
        if len(names) == 3:
            return dict(zip(names, [2, 2, 2])) if world_size == 8 else None
        inner = 2 if world_size % 2 == 0 else 1
        sizes = [world_size // inner, inner]
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
    p.add_argument("--dp-pp", default="auto", help="DP x PP sizes: 2x2; auto: (world/2) x 2; none")
    p.add_argument("--fsdp-tp", default="auto", help="FSDP x TP sizes: 2x2; auto: (world/2) x 2")
    p.add_argument("--dp-pp-tp", default="auto", help="DP x PP x TP sizes: 2x2x2; auto: on 8 ranks")
    p.add_argument("--hidden", type=int, default=32, help="H, features per token; tp divides it")
    p.add_argument(
        "--layers", type=int, default=4, help="MLP blocks; one per pipeline stage at least"
    )
    p.add_argument("--batch-size", type=int, default=16, help="global batch: images per step")
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches per GPipe step")
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
    parts = torch.arange(1, len(model) - 2).tensor_split(grid.size("pp"))
    blocks = parts[grid.coords["pp"]].tolist()
    start = 0 if grid.is_first("pp") else blocks[0]
    return model[start : len(model) if grid.is_last("pp") else blocks[-1] + 1]


def pipeline_step(stage: nn.Module, grid: Grid, x, y, m: int, hidden: int) -> None:
    """One GPipe step on this dp rank's batch: all m forwards, then all m backwards (lesson 09's schedule).
    Activations and their gradients travel by send/recv inside the pp group."""
    pp, me, group = grid.ranks_in("pp"), grid.coords["pp"], grid.group("pp")
    held = []  # (input, output) per micro-batch, kept for backward
    for xm, ym in zip(x.chunk(m), y.chunk(m)):
        h = xm  # (b, 8, 8) on the first stage
        if not grid.is_first("pp"):
            # (b, S, H) from the stage before
            h = torch.empty(len(xm), xm.shape[1], hidden, device=xm.device)
            dist.recv(h, pp[me - 1], group=group)
            h.requires_grad_()
        out = stage(h)
        if grid.is_last("pp"):
            out = F.cross_entropy(out, ym) / m  # the mean over this dp rank's batch, in m parts
        else:
            dist.send(out.detach(), pp[me + 1], group=group)
        held.append((h, out))
    for h, out in reversed(held):
        if grid.is_last("pp"):
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, pp[me + 1], group=group)
            out.backward(grad)
        if not grid.is_first("pp"):
            dist.send(h.grad, pp[me - 1], group=group)


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


def rows_of(counts, dim_of_op: dict, grid: Grid) -> list[dict]:
    """This rank's (collective, group) rows of `counts`, each op expected in the group of `dim_of_op[op]`."""
    return traffic_rows(counts, dim_of_op, {dim: grid.ranks_in(dim) for dim in grid.sizes})


def show_groups(report: Report, name: str, grid: Grid, rows: list[dict], info) -> list[dict]:
    """Rank 0 prints the grid and every (collective, group) seen in the step, from all ranks' rows."""
    everyone = gather_to_rank0(rows, info) or []
    seen = {(r["op"], tuple(r["ranks"])): r for rank_rows in everyone for r in rank_rows}
    table = [seen[k] for k in sorted(seen)]
    lines = [
        f"  {r['op']:>14} in the {r['dim']} group {r['ranks']}: {r['calls']} calls, buffer "
        f"{r['bytes']} bytes, sent {r['sent']} bytes per rank"
        for r in table
    ]
    text = "{grid}\n{lines}"
    grid_lines = "\n".join("  " + line for line in grid.describe())
    report.value(f"{name}_groups", table, text, grid=grid_lines, lines="\n".join(lines))
    # Only a collective's group can be misplaced: a send to the wrong peer would hang or break the equality
    # above, so send/recv are shown, not checked. With one group per dimension nothing can be misplaced.
    checked = [r for r in rows if r["op"] not in ("send", "recv")]
    if any(grid.size(r["dim"]) < info.world_size for r in checked):
        misplaced = max_over_ranks(sum(not r["in_its_group"] for r in checked))
        text = "  collectives seen outside the group of their dimension: {value:g}"
        report.claim(f"{name}_collectives_in_their_groups", misplaced, "==", 0, text)
    return table


# ---- the combinations ----------------------------------------------------------------------------------


def dp_pp(run: Run, sizes: dict) -> list[dict]:
    """PP x DP (x TP): pipeline stages by hand, gradients averaged over dp, tp split by hand."""
    grid = build_grid(run.info, sizes)
    name = "_".join(sizes)
    stage = stage_of(copy.deepcopy(run.model0), grid)  # a slice shares its modules: copy first
    tp_rank = grid.coords.get("tp", 0)
    if "tp" in sizes:
        stage = tensor_parallelize(stage, tp_rank, grid.size("tp"), grid.group("tp"))
    opt = torch.optim.SGD(stage.parameters(), lr=run.args.lr)
    dp_size, dp_rank = grid.size("dp"), grid.coords["dp"]
    for x, y in run.data:
        x, y = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
        opt.zero_grad()
        with count_collectives(p2p=True) as step:  # the last step's counts are the picture
            pipeline_step(stage, grid, x, y, run.args.microbatches, run.args.hidden)
        with count_collectives() as grads:
            average_over_dp(stage, grid)
        opt.step()
    diff = max_over_ranks(max_shard_diff(run.ref, stage, tp_rank))  # NaN-safe: a diverged run fails
    run.report.claim(
        f"{name}_equals_one_process",
        diff,
        "<=",
        TOL,
        "{shape}: after {steps} steps, max |parameter - one process on the global batch| = {value:.1e}",
        shape=" x ".join(f"{k}={v}" for k, v in grid.sizes.items()),
        steps=run.args.steps,
    )
    # the pipeline's all-reduces are tp's (inside a stage), the gradients' dp's
    dims = {"send": "pp", "recv": "pp", "all_reduce": "tp"}
    rows = rows_of(step, dims, grid) + rows_of(grads, {"all_reduce": "dp"}, grid)
    return show_groups(run.report, name, grid, rows, run.info)


def shard_fsdp_tp(model: nn.Sequential, grid: Grid) -> int:
    """parallelize_module on each block's MLP over tp, then fully_shard each block and the root over dp;
    returns the number of FSDP units."""
    for block in model[1:-2]:
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        parallelize_module(block.mlp, grid.submesh("tp"), plan)
        # each block's (tp-local) parameters: 1/dp per rank
        fully_shard(block, mesh=grid.submesh("dp"))
    # the root: embed and head, and the group of all units
    fully_shard(model, mesh=grid.submesh("dp"))
    return len(model[1:-2]) + 1


def fsdp_tp(run: Run, sizes: dict) -> list[dict]:
    """FSDP x TP: parallelize_module on the tp sub-mesh, then fully_shard on the dp sub-mesh."""
    grid = build_grid(run.info, sizes)
    model = copy.deepcopy(run.model0)
    # plain python (no mesh): nothing to shard
    units = shard_fsdp_tp(model, grid) if grid.mesh is not None else 0
    opt = torch.optim.SGD(model.parameters(), lr=run.args.lr)
    dp_size, dp_rank = grid.size("dp"), grid.coords["dp"]
    for x, y in run.data:
        x, y = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
        opt.zero_grad()
        with count_dtensor_collectives() as fwd:
            loss = F.cross_entropy(model(x), y)
        with count_dtensor_collectives() as bwd:
            loss.backward()  # fully_shard reduce-scatters gradients averaged over dp
        opt.step()
    # DTensor parameters are gathered whole to compare (full_tensor logs that a (dp, tp) shard takes 2)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    diff = max_over_ranks(max_shard_diff(run.ref, model, 0))
    run.report.claim(
        "fsdp_tp_equals_one_process",
        diff,
        "<=",
        TOL,
        "fsdp: dp={dp} x tp={tp}: after {steps} steps, max |parameter - one process on the global "
        "batch| = {value:.1e}",
        dp=sizes["dp"],
        tp=sizes["tp"],
        steps=run.args.steps,
    )
    # with dp = 1 every rank holds everything: FSDP gathers nothing
    if units and grid.size("dp") > 1:
        gathered = fwd.calls.get("all_gather", 0)
        text = "  {units} FSDP units ({blocks} blocks + the root): all-gathers in forward {value}"
        run.report.claim(
            "fsdp_tp_forward_all_gathers",
            gathered,
            "==",
            units,
            text,
            units=units,
            blocks=units - 1,
        )
        run.report.claim(
            "fsdp_tp_backward_all_gathers",
            bwd.calls.get("all_gather", 0),
            "==",
            units - 1,
            "  all-gathers in backward {value}: the root stays unsharded after forward",
        )
    dims = {"all_gather": "dp", "reduce_scatter": "dp", "all_reduce": "tp"}
    return show_groups(run.report, "fsdp_tp", grid, rows_of(merged(fwd, bwd), dims, grid), run.info)


# (parallelism, grid dimension, collective, when to choose it); DECISIONS_FROM: the runs a row reads
DECISIONS = [
    ("dp", "dp", "all_reduce", "the model fits on a rank: replicas, gradients all-reduced"),
    ("fsdp", "dp", "all_gather", "it does not fit: parameters gathered, forward and backward"),
    ("fsdp", "dp", "reduce_scatter", "  ... and gradients reduce-scattered: 1/dp kept per rank"),
    ("tp", "tp", "all_reduce", "a layer too big: activations all-reduced, on fast links"),
    ("pp", "pp", "send", "many layers, slow links: activations at stage boundaries"),
]
DECISIONS_FROM = {"fsdp": ["fsdp_tp"], "dp": ["dp_pp", "dp_pp_tp"]}  # the others: every run


def decision_table(report: Report, tables: dict, model0: nn.Module, args) -> None:
    """Which parallelism for which limit, with the busiest rank's bytes per step from this run's counts. The
    dp row's buffer, with pp > 1, is one pipeline stage's gradients, not the whole model's."""
    params = sum(p.numel() for p in model0.parameters())
    table, lines = [], []
    for kind, dim, op, when in DECISIONS:
        runs = DECISIONS_FROM.get(kind, list(tables))
        found = [r for run in runs for r in tables.get(run, []) if (r["op"], r["dim"]) == (op, dim)]
        if found:
            busiest = max(found, key=lambda r: r["sent"])
            row = {
                "parallelism": kind,
                "op": op,
                "bytes": busiest["bytes"],
                "sent": busiest["sent"],
            }
            table.append(row | {"when": when})
            numbers = f"buffer {row['bytes']:>7}, sent {row['sent']:>7} bytes"
            lines.append(f"  {kind:>4} {op:>14}: {numbers}  {when}")
    text = (
        "decision table for H={H}, {L} layers ({P} parameters, {nbytes} bytes), global batch {B} x 8 tokens\n"
        "  per step, busiest rank: the buffer handed to the collective, the bytes it sends (ring model)\n"
        "{lines}"
    )
    fields = {
        "H": args.hidden,
        "L": args.layers,
        "P": params,
        "nbytes": 4 * params,
        "B": args.batch_size,
    }
    report.value("decision_table", table, text, lines="\n".join(lines), **fields)


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
        run = Run(args, info, report, model0, data, one_process(model0, data, args.lr))
        tables = {}
        for name, combine in (("dp_pp", dp_pp), ("fsdp_tp", fsdp_tp), ("dp_pp_tp", dp_pp)):
            if args.meshes[name] is not None:
                tables[name] = combine(run, args.meshes[name])
        decision_table(report, tables, model0, args)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
