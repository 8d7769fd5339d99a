"""Lesson 13: sharded data parallelism: ZeRO 1, 2, 3 by hand, then PyTorch's versions (FSDP2).

    python lessons/13_sharded_data_parallel.py                                   # world of one: plain Adam
    torchrun --standalone --nproc_per_node=2 lessons/13_sharded_data_parallel.py
    torchrun --standalone --nproc_per_node=4 lessons/13_sharded_data_parallel.py
    torchrun --standalone --nproc_per_node=2 benchmarks/sharding_speed.py        # step times, largest model

Lesson 08 ends with the bytes a DDP rank holds: all parameters, gradients and Adam's two fp32 copies, on every
rank. Here each rank keeps 1/N of them. The model: lesson 08's ResidualMLP, width 33, depth 2, 6973 parameters
in flat units of 2145, 2244, 2244, 340 elements, each padded to a multiple of N where N does not divide it (as
printed: N = 2 and 4 pad the stem only, N = 8 all four units; the padding never reaches the model).

What to look for:
1. DDP's bytes per rank per step in the ring model (what NCCL sends): its all-reduce sends 2 Psi (N-1)/N.
2. ZeRO by hand, each stage vs DDP after --steps Adam steps on the same batches: equal up to float32 rounding
   (< 1e-3 of how far training moved the parameters, L2). Stages 1-2 send a reduce-scatter and an all-gather,
   DDP's bytes; stage 3 all-gathers twice (forward, backward): 1.5x. A model, not wire bytes: gloo implements
   reduce-scatter as an all-reduce, so on CPU stages 1-2 really move 1.5x and stage 3 2x.
3. `ZeroRedundancyOptimizer` equals stage 1; `fully_shard` per block, then the root, equals stage 3 and sends
   1.5x (more here: it pads each parameter's rows, 1.64x at width 33 on 4 ranks); reshard_after_forward=False
   keeps the gathered parameters from forward to the end of backward and sends stage 2's bytes;
   MixedPrecisionPolicy(bf16 params, fp32 reduce) all-gathers in bf16. Prefetching and CPU offload: lesson 14.
4. Bytes a rank holds (storages counted once): optimizer state 1/N from stage 1, gradients at the end of
   backward 1/N from stage 2, parameters at rest 1/N at stage 3, within the padding; activations (what
   autograd holds at the end of forward, measured for every row) as DDP's: sharding leaves them to lesson 08.
Saving this sharded state, and loading it on another number of ranks, is lesson 15.

Sources: ZeRO (arxiv.org/abs/1910.02054); PyTorch FSDP (arxiv.org/abs/2304.11277); Adam (arxiv.org/abs/
1412.6980); pytorch.org/docs/stable/distributed.fsdp.fully_shard.html.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from common.data import digits_split, global_batch_slices
from common.harness.env import DistInfo, LessonError, read_torchrun_env
from common.harness.grid import Grid
from common.harness.results import Report
from common.harness.session import add_distributed_args, distributed_session, run_main, set_seed
from common.measure.counters import CommCounter, count_collectives, local_shard
from common.measure.differences import max_abs_diff_all, max_over_ranks, relative_difference
from common.measure.memory import storage_bytes
from common.models import ResidualMLP
from common.sharding.accounting import (
    activation_bytes,
    full_params,
    memory_row,
    moved_bytes,
    rows_padded_bytes,
    table_text,
)
from common.sharding.fsdp import shard_blocks_then_root
from common.sharding.zero import ZeRO, check_stages, check_world_size, flat_units, padded_sizes

# Bound on relative_difference: float32 rounding stays far below it, a real error near 1.
EQUAL = 1e-3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--width", type=int, default=33, help="ResidualMLP width (33: N does not divide)"
    )
    p.add_argument("--depth", type=int, default=2, help="residual blocks (default 2)")
    p.add_argument("--global-batch", type=int, default=64, help="samples per step, all ranks")
    p.add_argument("--steps", type=int, default=5, help="Adam steps of every comparison")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    p.add_argument("--stages", default="1,2,3", help="ZeRO stages to build by hand (default 1,2,3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="digits .npz (default: the bundled data)")
    p.add_argument("--results", default=None, help="rank 0 writes the reported numbers here")
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validated before any process group: every rank fails alike and none waits in a collective.
    args.stages = check_stages(args.stages)
    world_size = read_torchrun_env()[2]
    if min(args.width, args.depth, args.steps, args.global_batch) < 1 or args.lr <= 0:
        raise LessonError("--width, --depth, --steps, --global-batch and --lr must be positive")
    if args.global_batch % world_size:
        raise LessonError(
            f"--global-batch {args.global_batch} cannot be split over {world_size} ranks"
        )
    check_world_size(unit_sizes(ResidualMLP(args.width, args.depth)), world_size)
    return args


def unit_sizes(model: ResidualMLP) -> dict[str, int]:
    """name -> elements of each flat unit."""
    return {name: sum(p.numel() for p in u.parameters()) for name, u in flat_units(model)}


def train(model, step, data, grads_of=None) -> tuple[list[float], int]:
    """forward, backward, step(), no grads left; returns the losses and the bytes of the gradients that
    grads_of() lists after the last backward (what a rank holds then; 0 without grads_of)."""
    losses, grad_bytes = [], 0
    for i, (x, y) in enumerate(data):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if grads_of is not None and i == len(data) - 1:
            grad_bytes = storage_bytes([local_shard(g) for g in grads_of() if g is not None])
        step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grad_bytes


def ddp(model, info, **kw) -> DDP:
    return DDP(model, device_ids=info.device_ids, **kw)


@dataclass
class Run:
    """What every section shares: arguments, the world, the report, the batches, the initial values."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    data: list
    init: dict
    group: object
    mesh: object
    init_params: list

    def fresh(self) -> ResidualMLP:
        """A new model with the shared initial values, loaded by each rank BEFORE sharding: ZeRO and
        fully_shard keep the slice of what this rank holds and, unlike DDP, broadcast nothing. (Too big for
        one rank: build it on the meta device and load it sharded, lesson 15.)"""
        m = ResidualMLP(self.args.width, self.args.depth).to(self.info.device)
        m.load_state_dict(self.init)
        return m

    def worst_diff(self, a, b, start=None) -> float:
        """Over ranks: max |a - b|, or ||a - b|| / ||b - start|| when `start` is given (NaN-safe)."""
        return max_over_ranks(relative_difference(a, b, start) if start else max_abs_diff_all(a, b))


# -------- 1. the reference: DDP (one process: plain Adam), gradients in DDP's buckets
def ddp_reference(run: Run, table: dict, psi: int) -> list:
    N = run.info.world_size
    raw = run.fresh()
    model = ddp(raw, run.info, gradient_as_bucket_view=True) if run.info.distributed else raw
    comm = CommCounter().register(model) if run.info.distributed else CommCounter()
    opt = torch.optim.Adam(raw.parameters(), lr=run.args.lr)
    losses, grad_bytes = train(
        model, opt.step, run.data, lambda: [p.grad for p in raw.parameters()]
    )
    run.report.record("ddp_losses", losses)
    moved = moved_bytes({"all_reduce": comm.bytes}, N) / run.args.steps
    activations = activation_bytes(raw, run.data[0][0])
    table["DDP"] = memory_row(raw.parameters(), opt, grad_bytes, activations, moved)
    run.report.claim(
        "ddp_bytes_as_formula",
        table["DDP"]["moved"],
        "==",
        2 * psi * (N - 1) / N,
        "1. {who}: {value:.0f} ring-model bytes per rank per step = 2 Psi (N-1)/N, Psi = {psi}",
        who="DDP" if N > 1 else "one process",
        psi=psi,
    )
    return [p.detach().clone() for p in raw.parameters()]


# -------- 2. ZeRO stages by hand, each against DDP
def zero_stage(run: Run, stage: int, table: dict, ref: list, psi_p: int) -> list:
    N = run.info.world_size
    m = run.fresh()
    zero = ZeRO(m, [u for _, u in flat_units(m)], stage, group=run.group, lr=run.args.lr)
    params = [*m.parameters(), *(u.shard for u in zero.units)]
    with count_collectives() as c:  # gradients: the model's (stage 1: full), the shards' (1/N)
        _, grad_bytes = train(m, zero.step, run.data, lambda: [p.grad for p in params])
    full = zero.full_parameters()
    moved = moved_bytes(c.bytes, N) / run.args.steps
    activations = activation_bytes(m, run.data[0][0])
    table[f"stage {stage}"] = memory_row(params, zero.optimizer, grad_bytes, activations, moved)
    run.report.claim(
        f"stage{stage}_equals_ddp",
        run.worst_diff(full, ref, run.init_params),
        "<=",
        EQUAL,
        "2. ZeRO stage {stage} by hand vs DDP after {steps} Adam steps: "
        "||difference|| / ||DDP's change|| = {value:.1e}",
        stage=stage,
        steps=run.args.steps,
    )
    same_shapes = all(p.shape == q.shape for p, q in zip(m.parameters(), run.fresh().parameters()))
    run.report.claim(
        f"stage{stage}_padding_untouched",
        int(zero.padding_is_zero() and same_shapes),
        "==",
        1,
        "  the padding of every shard is still 0, the model has its own shapes: {value}",
    )
    run.report.record(
        f"stage{stage}_calls", dict(c.calls)
    )  # {"all_gather_single": 20, ...} in 5 steps
    gathers = 2 if stage == 3 else 1  # stage 3 gathers before forward and again before backward
    ring_claim(run, f"stage{stage}", moved, gathers, "Psi_padded", psi_p, table["DDP"]["moved"])
    return full


def ring_claim(run: Run, name: str, moved: float, gathers: int, psi_name: str, psi, ddp) -> None:
    """The bytes a sharded setup sends per rank per step, as the ring model says: each all-gather (AG) and the
    reduce-scatter (RS) move Psi (N-1)/N, with Psi the bytes of the (padded) buffers they work on."""
    N = run.info.world_size
    run.report.claim(
        f"{name}_bytes_as_formula",
        moved,
        "==",
        (gathers + 1) * psi * (N - 1) / N,
        "  {setup}: {value:.0f} bytes/step = ({gathers} AG + 1 RS) x {psi_name} (N-1)/N: {ratio}",
        setup=name,
        gathers=gathers,
        psi_name=psi_name,
        ratio=f"{moved / ddp:.3f}x DDP's" if N > 1 else "none sent",
    )


# -------- 4. what each rank holds, and what it sends
def memory_claims(run: Run, table: dict) -> None:
    N = run.info.world_size
    ddp = table["DDP"]
    run.report.value(
        "memory_table",
        table,
        "4. bytes per rank: parameters at rest, gradients at the end of backward, Adam state,\n"
        "   activations held at the end of forward; bytes sent per step (ring model)\n{rows}",
        rows=table_text(table),
    )
    # + 0.01: the padding (< N elements per unit) and Adam's 4-byte step counters
    for stage in run.args.stages:
        sharded = ("optimizer_state", "gradients", "parameters")[:stage]  # stage s shards s of them
        for what in sharded:
            run.report.claim(
                f"stage{stage}_{what}_share",
                table[f"stage {stage}"][what] / ddp[what],
                "<=",
                1 / N + 0.01,
                "  stage {stage}: {what} {value:.3f} of DDP's (1/N = {share:.3f}, + padding)",
                stage=stage,
                what=what,
                share=1 / N,
            )
    if 1 in run.args.stages and N > 1:
        run.report.claim(
            "stage1_gradients_not_sharded",
            table["stage 1"]["gradients"] / ddp["gradients"],
            ">=",
            1.0,
            "  stage 1 still ends backward holding all gradients: {value:.3f} of DDP's",
        )
    off = [name for name, row in table.items() if row["activations"] != ddp["activations"]]
    run.report.claim(
        "activations_as_ddp",
        len(off),
        "==",
        0,
        "  activations held at the end of forward: {ddp} bytes for DDP; rows that differ: {value} {off}",
        ddp=ddp["activations"],
        off=" ".join(off),
    )


# -------- 3. PyTorch's versions
def fsdp2_runs(run: Run) -> dict:
    """name -> (model, optimizer, full parameters, bytes per op, gradient bytes) of 3 settings."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    settings = {
        "fsdp2": {
            "reshard_after_forward": True
        },  # the root too (fully_shard's default: not the root)
        "fsdp2_no_reshard": {"reshard_after_forward": False},
        "fsdp2_bf16": {"reshard_after_forward": True, "mp_policy": bf16},
    }
    runs = {}
    for name, kw in settings.items():
        m = shard_blocks_then_root(run.fresh(), run.mesh, **kw)
        opt = torch.optim.Adam(m.parameters(), lr=run.args.lr)
        with count_collectives() as c:
            _, grad_bytes = train(m, opt.step, run.data, lambda: [p.grad for p in m.parameters()])
        runs[name] = (m, opt, full_params(m), c.bytes, grad_bytes)
    return runs


def pytorch_versions(run: Run, hand: dict, table: dict) -> dict:
    N = run.info.world_size
    model = ddp(run.fresh(), run.info)
    zro = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.Adam, lr=run.args.lr
    )
    train(model, zro.step, run.data)
    if 1 in hand:
        run.report.claim(
            "zero_redundancy_optimizer_equals_stage1",
            run.worst_diff(model.parameters(), hand[1], run.init_params),
            "<=",
            EQUAL,
            "3. ZeroRedundancyOptimizer (whole tensors per rank, then broadcasts) vs stage 1: {value:.1e}",
        )
    runs = fsdp2_runs(run)
    moved = {name: moved_bytes(outcome[3], N) / run.args.steps for name, outcome in runs.items()}
    m, opt = runs["fsdp2"][:2]
    # activations: one forward of an untrained twin (FSDP2 expects a backward after each forward)
    x = run.data[0][0]
    activations = activation_bytes(
        shard_blocks_then_root(run.fresh(), run.mesh, reshard_after_forward=True), x
    )
    table["FSDP2"] = memory_row(m.parameters(), opt, runs["fsdp2"][4], activations, moved["fsdp2"])
    run.report.claim(
        "fsdp2_activations_as_ddp",
        table["FSDP2"]["activations"],
        "==",
        table["DDP"]["activations"],
        "  its activations held at the end of forward: {value} bytes, DDP's",
    )
    if 3 in hand:
        run.report.claim(
            "fsdp2_equals_stage3",
            run.worst_diff(runs["fsdp2"][2], hand[3], run.init_params),
            "<=",
            EQUAL,
            "  fully_shard (reshard_after_forward=True) vs stage 3: {value:.1e}",
        )
    held = activation_bytes(
        shard_blocks_then_root(run.fresh(), run.mesh, reshard_after_forward=False), x
    )
    run.report.claim(
        "fsdp2_no_reshard_keeps_parameters",
        held - table["FSDP2"]["activations"],
        ">=",
        1,
        "  reshard_after_forward=False holds {value} more bytes after forward: the gathered weights",
    )
    psi_rows = rows_padded_bytes(run.fresh(), N)  # fully_shard pads each parameter's rows
    for name, gathers in (("fsdp2", 2), ("fsdp2_no_reshard", 1)):
        ring_claim(
            run, name, moved[name], gathers, "Psi_rows_padded", psi_rows, table["DDP"]["moved"]
        )
    bf16_claims(run, runs)
    return runs


def bf16_claims(run: Run, runs: dict) -> None:
    """MixedPrecisionPolicy(bf16 params, fp32 reduce): another result, and 2/3 of the bytes."""
    bf16_params, fp32_params = runs["fsdp2_bf16"][2], runs["fsdp2"][2]
    run.report.value(
        "bf16_params_vs_fp32",
        run.worst_diff(bf16_params, fp32_params),
        "  MixedPrecisionPolicy(bf16 params, fp32 reduce) vs fp32: {value:.1e}",
    )
    run.report.claim(
        "bf16_really_ran",
        run.worst_diff(bf16_params, fp32_params, run.init_params),  # any lr: relative
        ">=",
        EQUAL,
        "  ... = {value:.2f} of fp32's change: bf16 really ran (rounding stays < 1e-3)",
    )
    # Per unit and step: 2 all-gathers (bf16: half the bytes) + 1 reduce-scatter (fp32): (2 x 1/2 + 1) / 3
    fp32, bf16 = sum(runs["fsdp2"][3].values()), sum(runs["fsdp2_bf16"][3].values())
    run.report.claim(
        "bf16_moves_fewer_bytes",
        3 * bf16 - 2 * fp32,
        "==",
        0,
        "  bytes handed to collectives: {ratio:.3f} of fp32's, 2/3: 3 x bf16 - 2 x fp32 = {value}",
        ratio=bf16 / fp32,
    )


def report_sizes(run: Run) -> tuple[int, int]:
    """The model, the padding of each flat unit on this world size; returns the bytes of the parameters (Psi)
    and of the padded flat buffers (Psi_padded)."""
    sizes = unit_sizes(run.fresh())
    padded = padded_sizes(sizes, run.info.world_size)
    n = sum(sizes.values())
    run.report.record("world_size", run.info.world_size)
    run.report.record("n_params", n)
    run.report.value(
        "padded_units",
        padded,
        "world_size {N}, ResidualMLP width {width} depth {depth}: {n} parameters, Psi = {psi} bytes\n"
        "  flat units padded to {value} ({psi_p} bytes); padding: {pads}",
        N=run.info.world_size,
        width=run.args.width,
        depth=run.args.depth,
        n=n,
        psi=4 * n,
        psi_p=4 * sum(padded.values()),
        pads=", ".join(f"{k} +{padded[k] - v}" for k, v in sizes.items() if padded[k] > v)
        or "none",
    )
    return 4 * n, 4 * sum(padded.values())


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        N, report = info.world_size, Report(info)
        grid = Grid(info, dp=N)  # one process: sizes 1, no group, no mesh
        train_set, _ = digits_split(path=args.data)
        set_seed(args.seed)
        init = (
            ResidualMLP(args.width, args.depth).to(info.device).state_dict()
        )  # every model's start
        batches = global_batch_slices(
            train_set, args.steps, args.global_batch, args.seed, info.rank, N, device=info.device
        )
        run = Run(
            args=args,
            info=info,
            report=report,
            data=batches,
            init=init,
            group=grid.group("dp"),
            mesh=grid.submesh("dp"),
            init_params=[t.clone() for t in init.values()],
        )
        psi, psi_p = report_sizes(run)
        table = {}
        ref = ddp_reference(run, table, psi)
        hand = {stage: zero_stage(run, stage, table, ref, psi_p) for stage in args.stages}
        if info.distributed:  # FSDP2 and ZeroRedundancyOptimizer need a process group
            pytorch_versions(run, hand, table)  # adds the FSDP2 row
        memory_claims(run, table)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
