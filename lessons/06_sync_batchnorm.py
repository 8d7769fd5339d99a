"""Lesson 06: SyncBatchNorm -- BatchNorm statistics over the global batch, and what DDP does with BatchNorm
buffers.

    python lessons/06_sync_batchnorm.py                                    # one process: the variants agree
    torchrun --standalone --nproc_per_node=4 lessons/06_sync_batchnorm.py  # 4 processes x 4 samples per step
    torchrun --standalone --nproc_per_node=4 lessons/06_sync_batchnorm.py --group-size 2  # {0,1} and {2,3}
    torchrun --standalone --nproc_per_node=2 lessons/06_sync_batchnorm.py --batch-size 2 --sync-impl scratch

What to look for (each number is a claim with its bound, recorded in --results):
1. The code to copy: `convert_sync_batchnorm(raw_model, group)` BEFORE the DDP wrap (DDP records the modules
   and buffers it finds when built); it swaps the BatchNorm children of the model you pass IN PLACE.
   SyncBatchNorm normalises with its group's global batch: one collective per layer in forward (an all-gather
   in nn.SyncBatchNorm, an all-reduce of sums in ours) and one in backward; identical running statistics.
2. Plain BatchNorm under DDP(..., forward_sync_buffers=False): each rank normalises with ITS micro-batch (4
   samples, not the global 16) and updates ITS running statistics; DDP averages gradients, never buffers: they
   drift apart.
3. DDP's default, forward_sync_buffers=True (torch 2.13's name; `broadcast_buffers` is deprecated), broadcasts
   rank 0's buffers before a forward only when the previous forward ran with gradient sync
   (common/data_parallel/ddp_buffers.py quotes the source): once per training step, once per optimizer step
   under no_sync, once per evaluation loop (at its first batch), not at the training step after it. It hides
   the drift (every rank evaluates rank 0's statistics) without fixing it: they are rank 0's micro-batches'
   statistics, not the global batch's.
4. --group-size 2: `Grid(info, replica=2, bn=2)`; dimension `bn` holds the ranks that share statistics, {0,1}
   and {2,3} (consecutive ranks: on GPUs, one node); `replica` numbers those groups.
5. `common.data_parallel.bn_stats.replay` computes rank 0's run in one process (claims `replay_equals_ddp_*`);
   notebook 06 sweeps the per-rank batch with it: on 8x8 digits SyncBatchNorm's mean gain over 3 seeds stays
   within 3 points at every per-rank batch (Wu & He: BatchNorm's ImageNet error 10.6 points above GroupNorm's
   at 2 images per GPU). [perf] step time SyncBatchNorm / BatchNorm: 4 more collectives per step.
6. Which SyncBatchNorm runs: `torch.nn.SyncBatchNorm` on CUDA; on CPU, where torch 2.13's raises (its forward
   accepts cuda, hpu, xpu, PrivateUse1) and DDP refuses it, the from-scratch one,
   `common.data_parallel.sync_batchnorm` (`choose_sync_impl` picks; --sync-impl overrides).

Sources: Ioffe & Szegedy 2015 (arxiv.org/abs/1502.03167); MegDet, Peng et al. 2018 (arxiv.org/abs/1711.07240);
Wu & He 2018 (arxiv.org/abs/1803.08494); pytorch.org/docs/stable/generated/torch.nn.SyncBatchNorm.html; DDP's
source.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from common.data import digits_split
from common.data_parallel.bn_stats import (
    batches,
    batchnorm_modules,
    gather_stats,
    global_batch_tracker,
    loader_for,
    local_accuracy,
    replay,
    running_stats,
    spread,
    train_counted,
)
from common.data_parallel.ddp_buffers import broadcasts_after_eval, count_buffer_broadcasts
from common.data_parallel.sync_batchnorm import choose_sync_impl, convert_sync_batchnorm
from common.harness.compat import ddp_buffer_sync  # forward_sync_buffers= on torch >= 2.13
from common.harness.env import DistInfo, LessonError, choose_backend_and_device, read_torchrun_env
from common.harness.grid import Grid
from common.harness.ranks import gather_to_rank0, max_param_diff_across_ranks
from common.harness.results import Report
from common.harness.session import (
    add_distributed_args,
    distributed_session,
    rank0_only,
    run_main,
    set_seed,
)
from common.measure.differences import max_abs_diff_all, nan_max
from common.models import DigitsCNN

DRIFT = 1e-3  # a spread of running statistics at least this large is drift, not rounding (float32: ~1e-7)
ROUNDING = 1e-4  # the replay adds gradients in another order than DDP: ~1e-7 a step, over 60 steps
PAD = " " * 11  # a variant's claims, indented under its name
IMPLS = {
    "torch": "torch.nn.SyncBatchNorm",
    "scratch": "common.data_parallel.sync_batchnorm.SyncBatchNorm (from scratch)",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-steps", type=int, default=60, help="steps per variant, 0 = one epoch")
    # small on purpose; the global batch is batch-size x world_size
    p.add_argument("--batch-size", type=int, default=4, help="samples per process per step")
    p.add_argument("--lr", type=float, default=0.02, help="SGD learning rate")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--seed", type=int, default=0, help="model init and data order (every rank)")
    p.add_argument("--data", default=None, help="digits .npz (default: data/digits.npz)")
    impl = "torch's nn.SyncBatchNorm (CUDA), the from-scratch one, or auto: torch on CUDA"
    p.add_argument("--sync-impl", choices=["auto", "torch", "scratch"], default="auto", help=impl)
    p.add_argument("--group-size", type=int, default=0, help="ranks per statistics group, 0: all")
    p.add_argument("--results", default=None, help="rank 0 writes the numbers here as JSON")
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validate before any process group exists: every rank sees the same argv and environment: all fail alike
    if args.batch_size < 1 or args.max_steps < 0 or args.lr <= 0:
        raise LessonError(
            f"need --batch-size >= 1, --max-steps >= 0, --lr > 0; got {args.batch_size}, "
            f"{args.max_steps}, {args.lr}"
        )
    _, local_rank, world_size, local_world_size = read_torchrun_env()
    _, device = choose_backend_and_device(args.backend, args.device, local_rank, local_world_size)
    args.sync_impl = choose_sync_impl(args.sync_impl, device)
    if args.group_size < 0 or (args.group_size and world_size % args.group_size):
        raise LessonError(
            f"--group-size {args.group_size} must be 0 or divide the world size {world_size}"
        )
    return args


def build(variant: str, args, info, bn_group) -> tuple[nn.Module, nn.Module]:
    """(raw_model, model): "syncbn" is the code to copy; "batchnorm" keeps each rank's buffers;
    "batchnorm_default" is BatchNorm under DDP's default buffer broadcast. One seed: the same init for all."""
    set_seed(args.seed)
    raw_model = DigitsCNN().to(info.device)
    # BEFORE the DDP wrap, which records the layers it finds. Both converters swap the BatchNorm children of
    # raw_model IN PLACE (and return raw_model itself)
    if variant == "syncbn":
        if args.sync_impl == "torch":
            nn.SyncBatchNorm.convert_sync_batchnorm(raw_model, bn_group)
        else:
            convert_sync_batchnorm(raw_model, bn_group)
    if not info.distributed:
        return raw_model, raw_model
    # False: each rank keeps its own statistics; True (DDP's default) broadcasts rank 0's
    sync_buffers = ddp_buffer_sync(variant == "batchnorm_default")
    device_ids = [info.local_rank] if info.device.type == "cuda" else None
    return raw_model, DDP(raw_model, device_ids=device_ids, **sync_buffers)


@dataclass
class Run:
    """What every variant shares: the options, this rank, the report, the grid (its dimension bn:
    the ranks that share statistics) with those groups as rank lists, the data and its loader, the
    steps a variant trains, and the channels of the model's BatchNorm layers."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    grid: Grid
    groups: list
    train_set: TensorDataset
    test_set: TensorDataset
    loader: DataLoader
    steps: int
    channels: list


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        g = args.group_size or info.world_size
        grid = Grid(info, replica=info.world_size // g, bn=g)  # bn: ranks that share statistics
        groups = sorted({tuple(m) for m in gather_to_rank0(grid.ranks_in("bn"), info) or [[0]]})
        train_set, test_set = digits_split(path=args.data)  # (1438, 1, 8, 8), (359, 1, 8, 8)
        loader = loader_for(train_set, args.batch_size, info.world_size, info.rank, args.seed)
        channels = [m.num_features for _, m in batchnorm_modules(DigitsCNN())]  # [16, 32]
        steps = args.max_steps or len(loader)
        run = Run(
            args, info, Report(info), grid, groups, train_set, test_set, loader, steps, channels
        )
        report_setup(run)
        variants, rank0 = run.report.record("variants", {}), {}

        # ---- 1. SyncBatchNorm (the code to copy), then 2. plain BatchNorm, each rank its own buffers -------
        for variant in ("syncbn", "batchnorm"):
            variants[variant], rank0[variant] = measure(run, variant)
        ratio = variants["syncbn"]["mean_step_s"] / variants["batchnorm"]["mean_step_s"]
        text = "mean step time SyncBatchNorm / BatchNorm: {value:.2f}"
        run.report.perf("step_time_ratio", ratio, text)
        with rank0_only(info, "the one-process replay") as mine:
            if mine and g == info.world_size:
                check_replay(run, rank0)

        # ---- 3. DDP's default, forward_sync_buffers=True: when it broadcasts, and what it hides ------------
        if info.distributed:
            default_buffer_sync(run, no_sync_model=rank0["batchnorm"])
        run.report.finish(args.results)


def report_setup(run: Run) -> None:
    """The run's shape, the SyncBatchNorm implementation and the groups that share statistics."""
    run.report.value(
        "setup",
        [run.info.world_size, run.args.batch_size, run.steps],
        "world_size {value[0]}, {value[2]} steps of {value[0]} x {value[1]} samples ({backend}, {device})",
        backend=run.info.backend,
        device=run.info.device.type,
    )
    impl = IMPLS[run.args.sync_impl]
    run.report.value(
        "sync_impl", run.args.sync_impl, "SyncBatchNorm implementation: {impl}", impl=impl
    )
    run.report.value(
        "bn_groups",
        [list(m) for m in run.groups],
        "SyncBatchNorm process groups (Grid dimension bn): {groups}",
        groups=" ".join(str(list(m)) for m in run.groups),
    )
    run.report.record("group_of_rank", gather_to_rank0(run.grid.coords["replica"], run.info))


def check_replay(run: Run, rank0: dict) -> None:
    """Rank 0: `replay` of each variant in one process equals rank 0's DDP run (parameters and statistics)."""
    shape = (
        run.args.batch_size,
        run.info.world_size,
        run.steps,
        run.args.lr,
        run.args.seed,
        run.args.momentum,
    )
    for variant in ("syncbn", "batchnorm"):
        twin = replay(variant, run.train_set, *shape, device=run.info.device)
        # parameters, then running statistics; a NaN anywhere is the largest
        gap = max_abs_diff_all(
            [*rank0[variant].parameters(), running_stats(rank0[variant])],
            [*twin.parameters(), running_stats(twin)],
        )
        run.report.claim(
            f"replay_equals_ddp_{variant}",
            gap,
            "<=",
            ROUNDING,
            "one-process replay of rank 0's {variant} run: max |diff| {value:.1e}",
            variant=variant,
        )


def measure(run: Run, variant: str):
    """Train one variant on every rank; report its collectives, its buffers' spread and broadcasts, its
    accuracy. Returns (what was measured, raw_model)."""
    with count_buffer_broadcasts() as built:
        raw_model, model = build(variant, run.args, run.info, run.grid.group("bn"))
    # raw_model is the DigitsCNN object passed in: were its 2 BatchNorm2d layers swapped?
    if variant == "syncbn":
        swapped = sum(type(m).__name__ == "SyncBatchNorm" for _, m in batchnorm_modules(raw_model))
        text = "convert_sync_batchnorm swapped {value} BatchNorm2d for SyncBatchNorm"
        run.report.claim("convert_swaps_in_place", swapped, "==", len(run.channels), text)
    curve = []

    def log(step: int) -> None:  # the spread of the running means, every 10 steps
        curve.append([step, spread(gather_stats(raw_model, run.info), run.channels)[0]])

    with count_buffer_broadcasts() as sent:
        v = train_counted(
            model, raw_model, batches(run.loader, run.steps), run.args, run.info, log=log
        )
    stats = gather_stats(raw_model, run.info)  # (world_size, 96) for this CNN
    acc = gather_to_rank0(local_accuracy(raw_model, run.test_set), run.info) or []  # [] off rank 0
    v.update(
        spread_curve=curve,
        first_layer_running_mean=stats[:, : run.channels[0]].tolist(),
        max_param_diff=max_param_diff_across_ranks(raw_model, run.info),
        test_accuracy_per_rank=acc,
        broadcasts_in_training=len(sent),
    )
    v["spread_running_mean"], v["spread_running_var"] = spread(stats, run.channels)
    v["spread_within_groups"] = nan_max(
        nan_max(spread(stats[list(m)], run.channels)) for m in run.groups
    )
    run.report.value(
        f"{variant}_test_accuracy",
        acc,
        "{variant:>9}: {steps} steps, test accuracy per rank {acc}",
        variant=variant,
        steps=v["steps"],
        acc=" ".join(f"{a:.4f}" for a in acc),
    )
    variant_claims(
        run.report, variant, v, len(run.channels) if len(run.groups[0]) > 1 else 0, run.info
    )
    if variant == "syncbn":
        syncbn_claims(run.report, v, stats, acc, run.groups, run.channels)
    elif run.info.world_size > 1:
        batchnorm_claims(run.report, v, raw_model, built)
    return v, raw_model


def variant_claims(report: Report, variant: str, v: dict, sync_layers: int, info) -> None:
    """Every variant: its collectives per step, identical parameters, no buffer broadcast in training."""
    c = v["collectives_per_step"]
    layers = sync_layers if variant == "syncbn" else 0  # one collective per synchronised layer
    text = PAD + "collectives per step of the BatchNorm layers: forward {value}"
    report.claim(f"{variant}_forward_collectives", c["forward"], "==", layers, text)
    report.claim(
        f"{variant}_backward_collectives", c["backward"], "==", layers, PAD + "... backward {value}"
    )
    report.claim(
        f"{variant}_ddp_bucket_allreduces",
        c["ddp_buckets"],
        "==",
        int(info.distributed),
        PAD + "... plus {value} DDP gradient bucket all-reduce (150 KB of gradients < the 1 MiB "
        "first bucket)",
    )
    text = PAD + "max |parameter difference| across ranks: {value:.1e} (DDP)"
    report.claim(f"{variant}_params_identical_across_ranks", v["max_param_diff"], "==", 0.0, text)
    text = PAD + "buffer broadcasts in training (forward_sync_buffers=False): {value}"
    report.claim(f"{variant}_no_forward_broadcasts", v["broadcasts_in_training"], "==", 0, text)


def syncbn_claims(report: Report, v: dict, stats, acc: list, groups: list, channels: list) -> None:
    """SyncBatchNorm: identical statistics (and accuracy) within each group, different between groups."""
    text = PAD + "running-statistics spread within each group: {value:.1e}"
    report.claim("syncbn_stats_identical_within_group", v["spread_within_groups"], "==", 0.0, text)
    if acc:
        spread_acc = max(max(acc[r] for r in m) - min(acc[r] for r in m) for m in groups)
        text = PAD + "test-accuracy spread within each group: {value}"
        report.claim("syncbn_accuracy_identical_within_group", spread_acc, "==", 0.0, text)
    if len(groups) > 1:
        v["spread_across_groups"] = spread(stats[[m[0] for m in groups]], channels)[0]
        report.claim(
            "syncbn_stats_differ_between_groups",
            v["spread_across_groups"],
            ">=",
            DRIFT,
            PAD + "running-mean spread between groups: {value:.2e}",
        )


def batchnorm_claims(report: Report, v: dict, raw_model, built: list[int]) -> None:
    """Plain BatchNorm, 2+ ranks: each rank's statistics drift apart; DDP's construction sent the buffers."""
    text = PAD + "running-mean spread between ranks: {value:.2e} (each rank its own)"
    report.claim("batchnorm_running_mean_drifts", v["spread_running_mean"], ">=", DRIFT, text)
    text = PAD + "running-var spread between ranks: {value:.2e}"
    report.claim("batchnorm_running_var_drifts", v["spread_running_var"], ">=", DRIFT, text)
    params = sum(p.numel() * p.element_size() for p in raw_model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in raw_model.buffers())
    report.claim(
        "construction_sends_buffers",
        built[0] - params,
        "==",
        buffers,
        "DDP's construction sent the parameters and {value} bytes of buffers "
        "(forward_sync_buffers=False too)",
    )


def default_buffer_sync(run: Run, no_sync_model: nn.Module) -> None:
    """3. Plain BatchNorm under DDP's default: the broadcasts of a training step; rank 0's statistics."""
    raw_model, model = build("batchnorm_default", run.args, run.info, None)
    # tracker: the statistics of the world's batch
    with global_batch_tracker(raw_model) as tracker, count_buffer_broadcasts() as sent:
        train_counted(model, raw_model, batches(run.loader, run.steps), run.args, run.info)
    run.report.claim(
        "broadcasts_per_training_step",
        len(sent) / run.steps,
        "==",
        1,
        "forward_sync_buffers=True: {sent} buffer broadcasts in {steps} training steps "
        "({value:g} per step, {size} bytes each)",
        sent=len(sent),
        steps=run.steps,
        size=sent[0],
    )
    mine = running_stats(raw_model)
    # rank 0's statistics are the source of every broadcast: never overwritten
    if run.info.master_process:
        run.report.claim(
            "default_rank0_same_as_without_sync",
            (mine - running_stats(no_sync_model)).abs().max(),
            "==",
            0.0,
            "rank 0's running statistics equal those of the forward_sync_buffers=False run: {value:.1e}",
        )
        if run.info.world_size > 1:  # one rank's batch IS the global batch: nothing to differ from
            run.report.claim(
                "default_rank0_differs_from_global_batch",
                (mine - running_stats(tracker)).abs().max(),
                ">=",
                DRIFT,
                "... and differ from the global batch's (tracked) by {value:.2e}",
            )
    buffer_sync_in_evaluation(run, model, raw_model)


def buffer_sync_in_evaluation(run: Run, model: nn.Module, raw_model: nn.Module) -> None:
    """3, continued: an evaluation through the wrapper sends once and hides the drift; the training step
    after it sends nothing; under no_sync, one broadcast per optimizer step."""
    with count_buffer_broadcasts() as sent:  # THROUGH the wrapper: 3 forwards of 128 under no_grad
        acc = gather_to_rank0(local_accuracy(model, run.test_set), run.info)
    run.report.claim(
        "broadcasts_per_evaluation",
        len(sent),
        "==",
        1,
        "evaluation, 3 forwards under no_grad: {value} broadcast (at the first: the forward before "
        "it synced)",
    )
    # the larger of the running means' and variances' spread
    after = nan_max(spread(gather_stats(raw_model, run.info), run.channels))
    run.report.claim(
        "default_stats_equal_after_eval",
        after,
        "==",
        0.0,
        "spread of running statistics between ranks after it: {value:.1e} (all hold rank 0's: hidden)",
    )
    if acc:
        run.report.claim(
            "default_accuracy_identical",
            max(acc) - min(acc),
            "==",
            0.0,
            "test accuracy {acc:.4f} on every rank (spread {value}): rank 0's model everywhere",
            acc=acc[0],
        )
    first_step, accumulation = broadcasts_after_eval(model, batches(run.loader, 7), run.info.device)
    run.report.claim(
        "broadcasts_first_step_after_eval",
        first_step,
        "==",
        0,
        "first training step after it: {value} broadcasts (the forward before it ran under no_grad)",
    )
    run.report.claim(
        "broadcasts_per_accumulation_step",
        accumulation / 2,
        "==",
        1,
        "2 optimizer steps of 3 micro-steps, no_sync on 2: {sent} broadcasts ({value:g} per step, "
        "at the first)",
        sent=accumulation,
    )


if __name__ == "__main__":
    run_main(main)
