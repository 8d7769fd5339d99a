"""Lesson 13: sharded data parallelism: ZeRO 1, 2, 3 by hand, then FSDP2 and sharded checkpoints that reshard.

    python lessons/13_sharded_data_parallel.py                                   # world of one: plain Adam
    torchrun --standalone --nproc_per_node=2 lessons/13_sharded_data_parallel.py
    torchrun --standalone --nproc_per_node=4 lessons/13_sharded_data_parallel.py --save-sharded /tmp/ckpt13
    torchrun --standalone --nproc_per_node=2 lessons/13_sharded_data_parallel.py --load-sharded /tmp/ckpt13
    torchrun --standalone --nproc_per_node=2 benchmarks/sharding_speed.py        # step times, largest model

Lesson 08 ends with the bytes a DDP rank holds: all parameters, gradients and Adam's two fp32 copies, on every
rank. Here each rank keeps 1/N of them. The model: lesson 08's ResidualMLP, width 33, depth 2, 6973 parameters
in flat units of 2145, 2244, 2244, 340 elements, each padded to a multiple of N where N does not divide it (as
printed: N = 2 and 4 pad the stem only, N = 8 all four units; the padding never reaches the model).

What to look for:
1. ZeRO by hand, each stage vs DDP after --steps Adam steps on the same batches: equal up to float32 rounding
   (< 1e-3 of how far training moved the parameters, L2; common/shard_accounting.relative_difference).
2. Bytes a rank holds (storages counted once): optimizer state 1/N from stage 1, gradients at the end of
   backward 1/N from stage 2, parameters at rest 1/N at stage 3, within the padding; activations (what
   autograd holds at the end of forward, measured for every row) as DDP's: sharding leaves them to lesson 08.
3. Bytes per rank per step in the ring model (what NCCL sends), from the buffers handed to the collectives:
   DDP's all-reduce 2 Psi (N-1)/N; stages 1-2 a reduce-scatter and an all-gather, the same; stage 3
   all-gathers twice (forward, backward): 1.5x. A model, not wire bytes: gloo, which runs here, implements
   reduce-scatter as an all-reduce (ProcessGroupGloo), so on CPU stages 1-2 really move 1.5x and stage 3 2x.
4. `ZeroRedundancyOptimizer` equals stage 1; `fully_shard` per block, then the root, equals stage 3 and sends
   1.5x (more here: it pads each parameter's rows, 1.64x at width 33 on 4 ranks); reshard_after_forward=False
   keeps the gathered parameters from forward to the end of backward (measured) and sends stage 2's bytes;
   MixedPrecisionPolicy(bf16 params, fp32 reduce) all-gathers in bf16 (its distance to fp32 is recorded, not
   bounded: any two Adam runs stay within ~2 lr per step). Prefetching: FSDP2 prefetches one module ahead
   in backward by default (a module's pre-backward issues the all-gather of the module before it in forward
   order); the explicit `set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch` (further
   ahead, more parameters held) are not used here, nor CPUOffloadPolicy (a PCIe copy each way).
5. A sharded checkpoint saved by 4 ranks loads on 2 (difference 0.0) and training continues as on 4; the full
   state dict loads into the plain model; no COMPLETE.json (an unfinished save) or another model: exit 2.

Sources: ZeRO (arxiv.org/abs/1910.02054); PyTorch FSDP (arxiv.org/abs/2304.11277); Adam (arxiv.org/abs/
1412.6980); pytorch.org/docs/stable/ distributed.fsdp.fully_shard, distributed.checkpoint.
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from common.checkpoint.sharded import (
    FULL_MODEL,
    agreed_folder,
    check_complete,
    load_sharded,
    mark_complete,
    save_sharded,
)
from common.checkpoint.train_state import model_signature
from common.data import digits_split
from common.harness.env import DistInfo, LessonError, read_torchrun_env
from common.harness.grid import Grid
from common.harness.results import Report
from common.harness.session import (
    add_distributed_args,
    distributed_session,
    rank0_only,
    run_main,
    set_seed,
)
from common.measure.counters import CommCounter, count_collectives
from common.measure.differences import relative_difference
from common.measure.memory import ResidualMLP
from common.measure.precision import max_diff, worst_over_ranks
from common.sharding.accounting import activation_bytes, full_params, held_bytes, moved_bytes
from common.sharding.zero import ZeRO, check_stages, check_world_size

EQUAL = (
    1e-3  # bound on relative_difference: float32 rounding stays far below it, a real error near 1
)
CONTINUED = (
    "after_more_steps.pt"  # the saving world's parameters --more-steps later: a loader's target
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--width", type=int, default=33, help="ResidualMLP width (33: units N does not divide)"
    )
    p.add_argument("--depth", type=int, default=2, help="residual blocks (default 2)")
    p.add_argument(
        "--global-batch", type=int, default=64, help="samples per step, all ranks (default 64)"
    )
    p.add_argument(
        "--steps", type=int, default=5, help="Adam steps of every comparison (default 5)"
    )
    p.add_argument(
        "--more-steps", type=int, default=3, help="steps after the checkpoint (default 3)"
    )
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    p.add_argument("--stages", default="1,2,3", help="ZeRO stages to build by hand (default 1,2,3)")
    p.add_argument(
        "--save-sharded", metavar="DIR", help="save here (default: a temporary folder), load it"
    )
    p.add_argument(
        "--load-sharded", metavar="DIR", help="skip the save; load DIR, saved by any world size"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--data", default=None, help="digits .npz (default: the bundled data/digits.npz)"
    )
    p.add_argument(
        "--results", default=None, help="rank 0 writes the reported numbers here as JSON"
    )
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validated before any process group: every rank fails alike and none waits in a collective.
    args.stages = check_stages(args.stages)
    world_size = read_torchrun_env()[2]
    if (
        min(args.width, args.depth, args.steps, args.more_steps, args.global_batch) < 1
        or args.lr <= 0
    ):
        raise LessonError(
            "--width, --depth, --steps, --more-steps, --global-batch and --lr must be positive"
        )
    if args.global_batch % world_size:
        raise LessonError(
            f"--global-batch {args.global_batch} cannot be split over {world_size} ranks"
        )
    plain = ResidualMLP(args.width, args.depth)
    check_world_size(
        {name: sum(p.numel() for p in u.parameters()) for name, u in units(plain)}, world_size
    )
    if args.save_sharded and args.load_sharded:
        raise LessonError("give --save-sharded or --load-sharded, not both")
    if args.load_sharded:
        args.marker = check_complete(args.load_sharded, model_signature(plain))
    return args


def units(model: ResidualMLP) -> list:
    """(name, module) of the flat units: the stem, each residual block, the head."""
    blocks = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    return [("stem", model.stem), *blocks, ("head", model.head)]


def global_batches(train_set, first: int, count: int, args, info) -> list:
    """Steps first .. first+count-1 of one fixed stream of global batches; this rank's 1/N slice of each."""
    x_all, y_all = train_set.tensors
    perm = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(args.seed))
    b = args.global_batch // info.world_size  # per-rank micro-batch
    idx = [
        perm[(step * args.global_batch + info.rank * b + torch.arange(b)) % len(perm)]
        for step in range(first, first + count)
    ]
    return [
        (x_all[i].to(info.device), y_all[i].to(info.device)) for i in idx
    ]  # (b, 1, 8, 8), (b,) each


def train(model, step, data, probe=None) -> list[float]:
    """forward, backward, probe() after the last backward (what a rank holds then), step(), no grads left."""
    losses = []
    for i, (x, y) in enumerate(data):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if probe is not None and i == len(data) - 1:
            probe()
        step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def fsdp2(model, mesh, reshard_after_forward: bool = True, mp_policy=None):
    """fully_shard each block (its own all-gather and reduce-scatter), then the root (stem and head)."""
    kw = dict(
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy or MixedPrecisionPolicy(),
    )
    for block in model.blocks:
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


@dataclass
class Setup:
    """What every section shares: arguments, the world, the report, the batches, the initial values."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    train_set: object
    data: list
    init: dict
    group: object
    mesh: object
    init_params: list

    def fresh(self, same_init: bool = True) -> ResidualMLP:
        """A new model: the shared initial values, or new random ones (a load must overwrite them)."""
        m = ResidualMLP(self.args.width, self.args.depth).to(self.info.device)
        if same_init:
            # Every comparison starts from the same values. Each rank loads the whole state dict BEFORE
            # sharding because ZeRO and fully_shard keep the slice of what this rank already holds: unlike
            # DDP they broadcast nothing at wrap time, so ranks holding different values would shard different
            # models. (A model too big for one rank is built on the meta device and loaded sharded instead:
            # set_model_state_dict(..., StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)), a
            # full state dict on rank 0 only (tests/unit/test_zero.py runs it), or a sharded checkpoint.)
            m.load_state_dict(self.init)
        return m

    def worst_diff(
        self, a, b, start=None
    ) -> float:  # over ranks: max |a - b|, or relative to `start`
        return worst_over_ranks(
            [relative_difference(a, b, start) if start else max_diff(a, b)], self.info
        )[0]


# -------- 1. the reference: DDP (one process: plain Adam), gradients in DDP's buckets
def ddp_reference(s: Setup, table: dict, psi: int) -> list:
    info, args, N, raw = s.info, s.args, s.info.world_size, s.fresh()
    device_ids = [info.local_rank] if info.device.type == "cuda" else None
    model = (
        DDP(raw, gradient_as_bucket_view=True, device_ids=device_ids) if info.distributed else raw
    )
    comm = CommCounter().register(model) if info.distributed else CommCounter()
    opt, grads = torch.optim.Adam(raw.parameters(), lr=args.lr), {}

    def probe():
        grads.update(held_bytes([], [p.grad for p in raw.parameters()], opt))

    s.report.record("ddp_losses", train(model, opt.step, s.data, probe))
    table["DDP"] = {
        **held_bytes(list(raw.parameters()), [], opt),
        "gradients": grads["gradients"],
        "activations": activation_bytes(raw, s.data[0][0]),
        "moved": moved_bytes({"all_reduce": comm.bytes}, N) / args.steps,
    }
    s.report.claim(
        "ddp_bytes_as_formula",
        table["DDP"]["moved"],
        "==",
        2 * psi * (N - 1) / N,
        f"1. {'DDP' if N > 1 else 'one process'}: {{value:.0f}} ring-model bytes per rank per "
        f"step = 2 Psi (N-1)/N, Psi = {psi}",
    )
    return [p.detach().clone() for p in raw.parameters()]


# -------- 2. ZeRO stages by hand, each against DDP
def zero_stage(s: Setup, stage: int, table: dict, ref: list, psi_p: int) -> list:
    args, N, report = s.args, s.info.world_size, s.report
    m, grads = s.fresh(), {}
    zero = ZeRO(m, [u for _, u in units(m)], stage, group=s.group, lr=args.lr)

    def probe():  # the model's .grad (stage 1: full) and the shards' (stages 2-3: 1/N)
        shard_grads = [u.shard.grad for u in zero.units]
        grads.update(held_bytes([], [p.grad for p in m.parameters()] + shard_grads, zero.optimizer))

    with count_collectives() as c:
        train(m, zero.step, s.data, probe)
    full = zero.full_parameters()
    moved = moved_bytes(c.bytes, N) / args.steps
    held = held_bytes([*m.parameters(), *(u.shard for u in zero.units)], [], zero.optimizer)
    table[f"stage {stage}"] = {
        **held,
        "gradients": grads["gradients"],
        "activations": activation_bytes(m, s.data[0][0]),
        "moved": moved,
    }
    report.claim(
        f"stage{stage}_equals_ddp",
        s.worst_diff(full, ref, s.init_params),
        "<=",
        EQUAL,
        f"2. ZeRO stage {stage} by hand vs DDP after {args.steps} Adam steps: ||difference|| / "
        "||DDP's change|| = {value:.1e}",
    )
    same_shapes = all(p.shape == q.shape for p, q in zip(m.parameters(), s.fresh().parameters()))
    report.claim(
        f"stage{stage}_padding_untouched",
        int(zero.padding_is_zero() and same_shapes),
        "==",
        1,
        "  the padding of every shard is still 0, the model has its own shapes: {value}",
    )
    gathers = 2 if stage == 3 else 1  # stage 3 gathers before forward and again before backward
    calls = ", ".join(f"{k} x{v}" for k, v in sorted(c.calls.items()))
    ratio = f"{moved / table['DDP']['moved']:.3f}x DDP's" if N > 1 else "none sent"
    report.claim(
        f"stage{stage}_bytes_as_formula",
        moved,
        "==",
        (gathers + 1) * psi_p * (N - 1) / N,
        f"  ring-model bytes per rank per step {{value:.0f}} = ({gathers} all-gather + 1 "
        f"reduce-scatter) x Psi_padded (N-1)/N ({ratio}; {(gathers + 1) / 2:g}x without padding); "
        f"calls {calls}",
    )
    return full


# -------- 3. what each rank holds, and what it sends
def memory_claims(s: Setup, table: dict) -> None:
    N, report, ddp = s.info.world_size, s.report, table["DDP"]
    cols = ("parameters", "gradients", "optimizer_state", "activations", "moved")
    header = f"  {'':<9}" + "".join(f"{c:>16}" for c in cols)
    rows = [f"  {k:<9}" + "".join(f"{row[c]:>16.0f}" for c in cols) for k, row in table.items()]
    report.value(
        "memory_table",
        table,
        "3. bytes per rank (parameters at rest, gradients at the end of "
        "backward, Adam state, activations held at the end of forward; bytes sent per step)\n"
        + "\n".join([header, *rows]),
    )
    for stage in (
        s.args.stages
    ):  # + 0.01: the padding (< N elements per unit) and Adam's 4-byte step counters
        for what in ("optimizer_state", "gradients", "parameters")[
            :stage
        ]:  # stage s shards the first s
            share = table[f"stage {stage}"][what] / ddp[what]
            report.claim(
                f"stage{stage}_{what}_share",
                share,
                "<=",
                1 / N + 0.01,
                f"  stage {stage}: {what} {{value:.3f}} of DDP's (1/N = {1 / N:.3f}, + padding)",
            )
    if 1 in s.args.stages and N > 1:
        report.claim(
            "stage1_gradients_not_sharded",
            table["stage 1"]["gradients"] / ddp["gradients"],
            ">=",
            1.0,
            "  stage 1 still ends backward holding all gradients: {value:.3f} of DDP's",
        )
    off = [name for name, row in table.items() if row["activations"] != ddp["activations"]]
    report.claim(
        "activations_as_ddp",
        len(off),
        "==",
        0,
        "  activations held at the end of forward, "
        f"measured per row: {ddp['activations']} bytes for DDP; rows that differ: {{value}} "
        + " ".join(off),
    )


# -------- 4. PyTorch's versions
def fsdp2_runs(s: Setup) -> tuple[dict, dict]:
    """name -> (model, optimizer, full parameters, bytes per op) of 3 settings; the default's held grads."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    runs, grads = {}, {}
    for name, kw in (
        ("fsdp2", {}),
        ("fsdp2_no_reshard", {"reshard_after_forward": False}),
        ("fsdp2_bf16", {"mp_policy": bf16}),
    ):
        m = fsdp2(s.fresh(), s.mesh, **kw)
        opt = torch.optim.Adam(m.parameters(), lr=s.args.lr)

        def probe():
            grads.update(held_bytes([], [p.grad for p in m.parameters()], opt))

        with count_collectives() as c:
            train(m, opt.step, s.data, probe if name == "fsdp2" else None)
        runs[name] = (m, opt, full_params(m), c.bytes)
    return runs, grads


def pytorch_versions(s: Setup, hand: dict, table: dict) -> dict:
    args, info, report, N = s.args, s.info, s.report, s.info.world_size
    model = DDP(s.fresh(), device_ids=[info.local_rank] if info.device.type == "cuda" else None)
    zro = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=args.lr)
    train(model, zro.step, s.data)
    if 1 in hand:
        apart = s.worst_diff(model.parameters(), hand[1], s.init_params)
        report.claim(
            "zero_redundancy_optimizer_equals_stage1",
            apart,
            "<=",
            EQUAL,
            "4. ZeroRedundancy"
            "Optimizer (whole tensors per rank, then broadcasts) vs stage 1: {value:.1e}",
        )
    runs, grads = fsdp2_runs(s)
    moved = {name: moved_bytes(run[3], N) / args.steps for name, run in runs.items()}
    m, opt = runs["fsdp2"][:2]
    x = s.data[0][
        0
    ]  # activations: one forward of an untrained twin (FSDP2 expects a backward after forward)
    table["FSDP2"] = {
        **held_bytes(list(m.parameters()), [], opt),
        "gradients": grads["gradients"],
        "activations": activation_bytes(fsdp2(s.fresh(), s.mesh), x),
        "moved": moved["fsdp2"],
    }
    report.value(
        "fsdp2_memory",
        table["FSDP2"],
        "  fully_shard per block, then the root: "
        + ", ".join(f"{k} {v:.0f}" for k, v in table["FSDP2"].items()),
    )
    report.claim(
        "fsdp2_activations_as_ddp",
        table["FSDP2"]["activations"],
        "==",
        table["DDP"]["activations"],
        "  its activations held at the end of forward: {value} bytes, DDP's",
    )
    if 3 in hand:
        apart = s.worst_diff(runs["fsdp2"][2], hand[3], s.init_params)
        report.claim(
            "fsdp2_equals_stage3",
            apart,
            "<=",
            EQUAL,
            "  fully_shard (reshard_after_forward=True) vs stage 3: {value:.1e}",
        )
    held = activation_bytes(fsdp2(s.fresh(), s.mesh, reshard_after_forward=False), x)
    report.claim(
        "fsdp2_no_reshard_keeps_parameters",
        held - table["FSDP2"]["activations"],
        ">=",
        1,
        "  reshard_after_forward=False: {value} more bytes held at the end of forward than with "
        "True: the gathered weights backward needs (not the stem's: its input needs no gradient)",
    )
    fsdp2_bytes(s, runs, moved, table["DDP"]["moved"])
    return runs


def fsdp2_bytes(s: Setup, runs: dict, moved: dict, ddp_moved: float) -> None:
    N, report = s.info.world_size, s.report
    psi_f = 4 * sum(
        -(-p.shape[0] // N) * N * p[0].numel() for p in s.fresh().parameters()
    )  # rows padded
    for name, gathers in (("fsdp2", 2), ("fsdp2_no_reshard", 1)):
        report.claim(
            f"{name}_bytes_as_formula",
            moved[name],
            "==",
            (gathers + 1) * psi_f * (N - 1) / N,
            f"  {name}: {{value:.0f}} ring-model bytes per rank per step = ({gathers} all-gather "
            f"+ 1 reduce-scatter) x Psi_rows_padded (N-1)/N: {moved[name] / max(ddp_moved, 1):.3f}x "
            "DDP's",
        )
    bf16_diff = s.worst_diff(runs["fsdp2_bf16"][2], runs["fsdp2"][2])
    report.value(
        "bf16_params_vs_fp32",
        bf16_diff,
        "  MixedPrecisionPolicy(bf16 params, fp32 reduce) vs fp32: {value:.1e}",
    )
    apart = s.worst_diff(runs["fsdp2_bf16"][2], runs["fsdp2"][2], s.init_params)  # any lr: relative
    report.claim(
        "bf16_really_ran",
        apart,
        ">=",
        EQUAL,
        "  ... = {value:.2f} of fp32's change: bf16 really ran (rounding stays < 1e-3)",
    )
    # Per unit and step: 2 all-gathers (bf16: half the bytes) + 1 reduce-scatter (fp32): (2 x 1/2 + 1) / 3
    fp32, bf16 = sum(runs["fsdp2"][3].values()), sum(runs["fsdp2_bf16"][3].values())
    report.claim(
        "bf16_moves_fewer_bytes",
        3 * bf16 - 2 * fp32,
        "==",
        0,
        f"  bytes it hands to collectives: {bf16 / fp32:.3f} of fp32's = (2 all-gathers x 1/2 + 1 "
        "reduce-scatter in fp32) / 3 = 2/3; 3 x bf16 bytes - 2 x fp32 bytes = {value}",
    )


# -------- 5. sharded checkpoints
def save_and_continue(s: Setup, model, opt, ck: Path, more: list) -> None:
    """Save (rank 0 also the full model); train --more-steps: a loader's target; the marker comes last."""
    N = s.info.world_size
    save_sharded(model, opt, ck, s.info)
    train(model, opt.step, more)
    continued = [t.cpu() for t in full_params(model)]  # every rank takes part in the all-gathers
    if s.info.master_process:
        torch.save(continued, ck / CONTINUED)
    mark_complete(ck, s.info, model=model_signature(s.fresh()), world_size=N, step=s.args.steps)


def sharded_checkpoint(s: Setup, runs: dict) -> None:
    args, info, report, dev = s.args, s.info, s.report, s.info.device
    more = global_batches(s.train_set, args.steps, args.more_steps, args, info)
    ck = agreed_folder(args.load_sharded or args.save_sharded, info)  # or a temporary one
    if not args.load_sharded:
        save_and_continue(s, *runs["fsdp2"][:2], ck, more)
    marker = check_complete(ck, model_signature(s.fresh()))
    loaded = fsdp2(
        s.fresh(same_init=False), s.mesh
    )  # other initial values: the load must overwrite them
    opt = torch.optim.Adam(
        loaded.parameters(), lr=args.lr
    )  # a fresh Adam: its state comes from the files
    load_sharded(loaded, opt, ck)
    full = torch.load(ck / FULL_MODEL, map_location=dev, weights_only=True)
    report.claim(
        "sharded_load_equals_saved",
        s.worst_diff(full_params(loaded), full.values()),
        "==",
        0.0,
        f"5. sharded checkpoint saved by {marker['world_size']} ranks, loaded by {info.world_size}: "
        "max |difference| {value}",
    )
    x_probe = s.train_set.tensors[0][:64].to(dev)
    with torch.no_grad():  # (64, 10) logits of the loaded, sharded model (every rank takes part)
        logits = loaded(x_probe)
    report.record("continued_losses", train(loaded, opt.step, more))
    reference = torch.load(ck / CONTINUED, map_location=dev, weights_only=True)
    apart = s.worst_diff(full_params(loaded), reference, list(full.values()))
    report.claim(
        "continued_training_matches_saving_world",
        apart,
        "<=",
        EQUAL,
        f"  {args.more_steps} more "
        f"steps on {info.world_size} ranks vs the saving world's own: {{value:.1e}} of their change",
    )
    with rank0_only(info, "the single-process reader") as mine:
        if mine:
            single_process_reader(s, full, x_probe, logits)
            if not (args.save_sharded or args.load_sharded):
                shutil.rmtree(ck, ignore_errors=True)


def single_process_reader(s: Setup, full: dict, x_probe, logits) -> None:
    """Rank 0: the full state dict into the plain model, strict; its outputs against the sharded model's."""
    plain = ResidualMLP(s.args.width, s.args.depth).to(s.info.device)
    result = plain.load_state_dict(full, strict=True)  # raises on a missing or unexpected key
    s.report.value(
        "full_state_dict_strict_keys",
        len(result.missing_keys) + len(result.unexpected_keys),
        f"  {FULL_MODEL} (get_model_state_dict(full_state_dict=True, cpu_offload=True)) "
        "into the plain model, strict: missing + unexpected keys = {value}",
    )
    with (
        torch.no_grad()
    ):  # the same parameters, computed whole instead of gathered: rounding at most
        rel = max_diff([plain(x_probe)], [logits]) / max(logits.abs().max().item(), 1e-30)
    s.report.claim(
        "full_state_dict_same_outputs",
        rel,
        "<=",
        1e-6,
        "  its outputs vs the sharded model's: "
        "max |difference| / max |logit| = {value:.1e} (1e-6: a few float32 roundings)",
    )


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        N, report = info.world_size, Report(info)
        grid = Grid(info, dp=N)  # one process: sizes 1, no group, no mesh
        train_set, _ = digits_split(path=args.data)
        set_seed(args.seed)
        init = (
            ResidualMLP(args.width, args.depth).to(info.device).state_dict()
        )  # every model starts here
        s = Setup(
            args,
            info,
            report,
            train_set,
            global_batches(train_set, 0, args.steps, args, info),
            init,
            grid.group("dp"),
            grid.submesh("dp"),
            [t.clone() for t in init.values()],
        )
        sizes = {name: sum(p.numel() for p in u.parameters()) for name, u in units(s.fresh())}
        padded = {name: -(-n // N) * N for name, n in sizes.items()}
        n = sum(sizes.values())
        psi, psi_p = (
            4 * n,
            4 * sum(padded.values()),
        )  # bytes of the parameters, of the padded flat buffers
        report.results.update(
            world_size=N, global_batch=args.global_batch, steps=args.steps, n_params=n
        )
        pads = (
            ", ".join(f"{k} +{padded[k] - n}" for k, n in sizes.items() if padded[k] > n) or "none"
        )
        report.value(
            "padded_units",
            padded,
            f"world_size {N}, ResidualMLP width {args.width} depth "
            f"{args.depth}: {n} parameters, Psi = {psi} bytes; flat units padded to "
            f"{{value}} elements ({psi_p} bytes); padding: {pads}",
        )
        table = {}
        ref = ddp_reference(s, table, psi)
        hand = {stage: zero_stage(s, stage, table, ref, psi_p) for stage in args.stages}
        memory_claims(s, table)
        if info.distributed:  # FSDP2, ZeroRedundancyOptimizer and DCP need a process group
            runs = pytorch_versions(s, hand, table)  # adds the FSDP2 row
            sharded_checkpoint(s, runs)
        report.finish(args.results)


if __name__ == "__main__":
    run_main(main)
