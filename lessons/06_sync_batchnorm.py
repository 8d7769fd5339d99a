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
5. `replay` computes rank 0's run in one process (claims `replay_equals_ddp_*`); notebook 06 uses it to sweep
   the per-rank batch: on 8x8 digits (64 values per channel per sample) SyncBatchNorm's mean gain over 3 seeds
   stays within 3 points at every per-rank batch; Wu & He report BatchNorm's ImageNet error 10.6 points above
   GroupNorm's at 2 images per GPU.
6. [perf] step time SyncBatchNorm / BatchNorm: 4 more collectives per step (large here: 4 processes, 2 cores).
7. Which SyncBatchNorm runs: `torch.nn.SyncBatchNorm` on CUDA; on CPU, where torch 2.13's raises (its forward
   accepts cuda, hpu, xpu and PrivateUse1 devices) and DDP refuses it, the from-scratch
   `common.data_parallel.sync_batchnorm`.

Sources: Ioffe & Szegedy 2015 (arxiv.org/abs/1502.03167); MegDet, Peng et al. 2018 (arxiv.org/abs/1711.07240);
Wu & He 2018 (arxiv.org/abs/1803.08494); pytorch.org/docs/stable/generated/torch.nn.SyncBatchNorm.html; DDP's
source.
"""

from __future__ import annotations

import argparse
import itertools
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from common.data import digits_split
from common.data_parallel.bn_stats import (
    batchnorm_modules,
    gather_stats,
    global_batch_tracker,
    local_accuracy,
    running_stats,
    spread,
)
from common.data_parallel.ddp_buffers import count_buffer_broadcasts
from common.data_parallel.sync_batchnorm import convert_sync_batchnorm
from common.harness.compat import ddp_buffer_sync  # forward_sync_buffers= on torch >= 2.13
from common.harness.env import LessonError, choose_backend_and_device, read_torchrun_env
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
from common.measure.counters import CommCounter, count_collectives
from common.measure.differences import nan_max
from common.models import DigitsCNN

DRIFT = 1e-3  # a spread of running statistics at least this large is drift, not rounding (float32: ~1e-7)
ROUNDING = (
    1e-4  # the replay adds gradients in another order than DDP: ~1e-7 per step, grown over 60 steps
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--max-steps",
        type=int,
        default=60,
        help="steps per variant, 0 = one epoch (default %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=4,
        help="samples per process per step (small on purpose); the global batch is batch-size x "
        "world_size (default %(default)s)",
    )
    p.add_argument("--lr", type=float, default=0.02, help="SGD learning rate (default %(default)s)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument(
        "--seed", type=int, default=0, help="model init and data order (same on every rank)"
    )
    p.add_argument(
        "--data", default=None, help="digits .npz (default: the bundled data/digits.npz)"
    )
    p.add_argument(
        "--sync-impl",
        choices=["auto", "torch", "scratch"],
        default="auto",
        help="torch's nn.SyncBatchNorm (CUDA), the from-scratch one, or auto: torch on CUDA, "
        "else scratch",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=0,
        help="synchronise within groups of this many consecutive ranks (0 = all ranks)",
    )
    p.add_argument(
        "--results", default=None, help="rank 0 writes the reported numbers here as JSON"
    )
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
    if args.sync_impl == "auto":
        args.sync_impl = "scratch" if device.type == "cpu" else "torch"
    if args.sync_impl == "torch" and device.type == "cpu":
        raise LessonError(
            "--sync-impl torch: nn.SyncBatchNorm runs on accelerators only in torch 2.13 "
            "(cuda, hpu, xpu, PrivateUse1; its forward raises on CPU); use --sync-impl scratch "
            "or auto"
        )
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
        torch_or_ours = args.sync_impl == "torch"
        convert = (
            nn.SyncBatchNorm.convert_sync_batchnorm if torch_or_ours else convert_sync_batchnorm
        )
        convert(raw_model, bn_group)
    if not info.distributed:
        return raw_model, raw_model
    sync_buffers = ddp_buffer_sync(
        variant == "batchnorm_default"
    )  # False: each rank keeps its statistics
    return raw_model, DDP(
        raw_model,
        device_ids=[info.local_rank] if info.device.type == "cuda" else None,
        **sync_buffers,
    )


def loader_for(train_set, batch_size: int, world_size: int, rank: int, seed: int) -> DataLoader:
    return DataLoader(
        train_set,
        batch_size=batch_size,
        sampler=DistributedSampler(
            train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=seed
        ),
    )


def batches(loader: DataLoader, steps: int):
    """`steps` (x, y) batches over as many epochs as needed (set_epoch reshuffles each, alike everywhere)."""
    epochs = (
        loader.sampler.set_epoch(epoch) or loader for epoch in itertools.count()
    )  # lazy: one at a time
    return itertools.islice(itertools.chain.from_iterable(epochs), steps)


def train(model, raw_model, data, args, info, log=None) -> dict:
    """SGD over `data`; counts the collectives of the first step; `log(step)` every 10 steps."""
    optimizer = torch.optim.SGD(raw_model.parameters(), lr=args.lr, momentum=args.momentum)
    comm, counts, times = (
        CommCounter().register(model) if info.distributed else CommCounter(),
        {},
        [],
    )
    for step, (x, y) in enumerate(data, 1):
        x, y = x.to(info.device), y.to(info.device)  # x (B, 1, 8, 8), B = samples on this rank
        t0 = time.perf_counter()
        with count_collectives() as fwd:
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        with count_collectives() as bwd:
            loss.backward()  # SyncBatchNorm's backward all-reduces; DDP all-reduces gradient buckets
        optimizer.step()
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if (
            step == 1
        ):  # the comm hook calls dist.all_reduce too: take DDP's buckets out of "backward"
            counts = {
                "forward": fwd.total,
                "backward": bwd.total - comm.calls,
                "ddp_buckets": comm.calls,
            }
        if log and step % 10 == 0:
            log(step)
    warm = times[min(5, len(times) - 1) :]  # skip the first steps (allocation, counting)
    return {
        "steps": len(times),
        "final_loss": loss.item(),
        "collectives_per_step": counts,
        "mean_step_s": sum(warm) / len(warm),
    }


def replay(
    variant: str,
    train_set,
    batch_size: int,
    world_size: int,
    steps: int,
    lr: float,
    seed: int,
    momentum: float = 0.9,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Rank 0's end state of `world_size` DDP ranks, in one process on the run's device (CPU and CUDA round
    apart, 0.2 after 60 steps on an H200): each rank's micro-batch from its own DistributedSampler; "syncbn"
    normalises their concatenation, "batchnorm" each alone (rank 0's updates the statistics); gradients
    averaged as DDP does."""
    set_seed(seed)
    model = DigitsCNN().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    layers = batchnorm_modules(model)
    ranks = [
        batches(loader_for(train_set, batch_size, world_size, r, seed), steps)
        for r in range(world_size)
    ]
    for micro in zip(*ranks):  # one (x, y) per rank
        optimizer.zero_grad(set_to_none=True)
        if variant == "syncbn":  # one batch, the concatenation: SyncBatchNorm's statistics
            micro = [(torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))]
        for rank, (x, y) in reversed(
            list(enumerate(micro))
        ):  # rank 0 last: it leaves momentum at 0.1
            for _, m in layers:
                m.momentum = (
                    0.1 if rank == 0 else 0.0
                )  # 0: ranks 1.. leave rank 0's statistics alone
            (
                F.cross_entropy(model(x.to(device)), y.to(device)) / len(micro)
            ).backward()  # DDP's average
        optimizer.step()
    return model


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        report = Report(info)
        g = args.group_size or info.world_size
        grid = Grid(
            info, replica=info.world_size // g, bn=g
        )  # bn: the ranks that share BatchNorm statistics
        groups = sorted(
            {tuple(m) for m in gather_to_rank0(grid.ranks_in("bn"), info) or [[0]]}
        )  # on rank 0
        train_set, test_set = digits_split(
            path=args.data
        )  # (1438, 1, 8, 8) and (359, 1, 8, 8), every rank
        loader = loader_for(train_set, args.batch_size, info.world_size, info.rank, args.seed)
        steps = args.max_steps or len(loader)
        report_setup(report, args, info, grid, groups, steps)
        channels = [m.num_features for _, m in batchnorm_modules(DigitsCNN())]  # [16, 32]
        variants, rank0 = report.record("variants", {}), {}

        # ---- 1. SyncBatchNorm (the code to copy), then 2. plain BatchNorm, each rank its own buffers -------
        for variant in ("syncbn", "batchnorm"):
            variants[variant], rank0[variant] = measure(
                variant,
                args,
                info,
                grid.group("bn"),
                groups,
                loader,
                steps,
                test_set,
                channels,
                report,
            )
        ratio = variants["syncbn"]["mean_step_s"] / variants["batchnorm"]["mean_step_s"]
        report.perf(
            "step_time_ratio", ratio, "mean step time SyncBatchNorm / BatchNorm: {value:.2f}"
        )
        with rank0_only(info, "the one-process replay") as mine:
            if mine and g == info.world_size:
                check_replay(report, args, info, train_set, steps, rank0)

        # ---- 3. DDP's default, forward_sync_buffers=True: when it broadcasts, and what it hides ------------
        if info.distributed:
            default_buffer_sync(
                args, info, loader, steps, test_set, channels, report, rank0["batchnorm"]
            )
        report.finish(args.results)


def report_setup(report: Report, args, info, grid: Grid, groups: list, steps: int) -> None:
    """The run's shape, the SyncBatchNorm implementation and the groups that share statistics."""
    report.value(
        "setup",
        [info.world_size, args.batch_size, steps],
        "world_size {value[0]}, {value[2]} "
        f"steps of {{value[0]}} x {{value[1]}} samples ({info.backend}, {info.device.type})",
    )
    impl = (
        "torch.nn.SyncBatchNorm"
        if args.sync_impl == "torch"
        else "common.data_parallel.sync_batchnorm.SyncBatchNorm (from scratch)"
    )
    report.value("sync_impl", args.sync_impl, "SyncBatchNorm implementation: " + impl)
    report.value(
        "bn_groups",
        [list(m) for m in groups],
        "SyncBatchNorm process groups (Grid dimension bn): "
        + " ".join(str(list(m)) for m in groups),
    )
    report.record("group_of_rank", gather_to_rank0(grid.coords["replica"], info))


def check_replay(report: Report, args, info, train_set, steps: int, rank0: dict) -> None:
    """Rank 0: `replay` of each variant in one process equals rank 0's DDP run (parameters and statistics)."""
    for variant in ("syncbn", "batchnorm"):
        twin = replay(
            variant,
            train_set,
            args.batch_size,
            info.world_size,
            steps,
            args.lr,
            args.seed,
            args.momentum,
            info.device,
        )
        pairs = zip(
            [*rank0[variant].parameters(), running_stats(rank0[variant])],
            [*twin.parameters(), running_stats(twin)],
        )  # parameters, running statistics
        gap = nan_max((a - b).abs().max().item() for a, b in pairs)  # a NaN anywhere is the largest
        report.claim(
            f"replay_equals_ddp_{variant}",
            gap,
            "<=",
            ROUNDING,
            f"one-process replay of rank 0's {variant} run: max |diff| {{value:.1e}}",
        )


def measure(variant, args, info, bn_group, groups, loader, steps, test_set, channels, report):
    """Train one variant on every rank; report its collectives, its buffers' spread and broadcasts, its
    accuracy. Returns (what was measured, raw_model)."""
    with count_buffer_broadcasts() as built:
        raw_model, model = build(variant, args, info, bn_group)
    # raw_model is the DigitsCNN object passed in: were its 2 BatchNorm2d layers swapped?
    if variant == "syncbn":
        swapped = sum(type(m).__name__ == "SyncBatchNorm" for _, m in batchnorm_modules(raw_model))
        report.claim(
            "convert_swaps_in_place",
            swapped,
            "==",
            len(channels),
            "convert_sync_batchnorm swapped {value} BatchNorm2d for SyncBatchNorm",
        )
    curve = []

    def log(step: int) -> None:  # the spread of the running means, every 10 steps
        curve.append([step, spread(gather_stats(raw_model, info), channels)[0]])

    with count_buffer_broadcasts() as sent:
        v = train(model, raw_model, batches(loader, steps), args, info, log=log)
    stats = gather_stats(raw_model, info)  # (world_size, 96) for this CNN
    acc = gather_to_rank0(local_accuracy(raw_model, test_set), info) or []  # [] off rank 0
    v.update(
        spread_curve=curve,
        first_layer_running_mean=stats[:, : channels[0]].tolist(),
        max_param_diff=max_param_diff_across_ranks(raw_model, info),
        test_accuracy_per_rank=acc,
    )
    v["spread_running_mean"], v["spread_running_var"] = spread(stats, channels)
    v["spread_within_groups"] = nan_max(nan_max(spread(stats[list(m)], channels)) for m in groups)
    report.value(
        f"{variant}_test_accuracy",
        acc,
        f"{variant:>9}: {v['steps']} steps, test accuracy per rank "
        + " ".join(f"{a:.4f}" for a in acc),
    )
    c, pad = v["collectives_per_step"], " " * 11
    layers = len(channels) if variant == "syncbn" and len(groups[0]) > 1 else 0
    report.claim(
        f"{variant}_forward_collectives",
        c["forward"],
        "==",
        layers,
        pad + "collectives per step of the BatchNorm layers: forward {value}",
    )
    report.claim(
        f"{variant}_backward_collectives", c["backward"], "==", layers, pad + "... backward {value}"
    )
    report.claim(
        f"{variant}_ddp_bucket_allreduces",
        c["ddp_buckets"],
        "==",
        int(info.distributed),
        pad + "... plus {value} DDP gradient bucket all-reduce (150 KB of gradients < the 1 MiB "
        "first bucket)",
    )
    report.claim(
        f"{variant}_params_identical_across_ranks",
        v["max_param_diff"],
        "==",
        0.0,
        pad + "max |parameter difference| across ranks: {value:.1e} (DDP)",
    )
    report.claim(
        f"{variant}_no_forward_broadcasts",
        len(sent),
        "==",
        0,
        pad + "buffer broadcasts in training (forward_sync_buffers=False): {value}",
    )
    if variant == "syncbn":
        syncbn_claims(report, v, stats, acc, groups, channels, pad)
    elif info.world_size > 1:
        report.claim(
            "batchnorm_running_mean_drifts",
            v["spread_running_mean"],
            ">=",
            DRIFT,
            pad + "running-mean spread between ranks: {value:.2e} (each rank its own)",
        )
        report.claim(
            "batchnorm_running_var_drifts",
            v["spread_running_var"],
            ">=",
            DRIFT,
            pad + "running-var spread between ranks: {value:.2e}",
        )
        params = sum(p.numel() * p.element_size() for p in raw_model.parameters())
        buffers = sum(b.numel() * b.element_size() for b in raw_model.buffers())
        report.claim(
            "construction_sends_buffers",
            built[0] - params,
            "==",
            buffers,
            "DDP's construction, even with forward_sync_buffers=False, broadcast the parameters and "
            "{value} bytes of buffers",
        )
    return v, raw_model


def syncbn_claims(
    report: Report, v: dict, stats, acc: list, groups: list, channels: list, pad: str
) -> None:
    """SyncBatchNorm: identical statistics (and accuracy) within each group, different between groups."""
    report.claim(
        "syncbn_stats_identical_within_group",
        v["spread_within_groups"],
        "==",
        0.0,
        pad + "running-statistics spread within each group: {value:.1e}",
    )
    if acc:
        spread_acc = max(max(acc[r] for r in m) - min(acc[r] for r in m) for m in groups)
        report.claim(
            "syncbn_accuracy_identical_within_group",
            spread_acc,
            "==",
            0.0,
            pad + "test-accuracy spread within each group: {value}",
        )
    if len(groups) > 1:
        v["spread_across_groups"] = spread(stats[[m[0] for m in groups]], channels)[0]
        report.claim(
            "syncbn_stats_differ_between_groups",
            v["spread_across_groups"],
            ">=",
            DRIFT,
            pad + "running-mean spread between groups: {value:.2e}",
        )


def default_buffer_sync(
    args, info, loader, steps, test_set, channels, report, no_sync_model
) -> None:
    """Plain BatchNorm under DDP's default: count the broadcasts of each kind of forward; the drift."""
    raw_model, model = build("batchnorm_default", args, info, None)
    # tracker: the statistics of the world's batch
    with global_batch_tracker(raw_model) as tracker, count_buffer_broadcasts() as sent:
        train(model, raw_model, batches(loader, steps), args, info)
    report.claim(
        "broadcasts_per_training_step",
        len(sent) / steps,
        "==",
        1,
        f"forward_sync_buffers=True: {len(sent)} buffer broadcasts in {steps} training steps "
        f"({{value:g}} per step, {sent[0]} bytes each)",
    )
    mine = running_stats(raw_model)
    if (
        info.master_process
    ):  # rank 0's statistics are the source of every broadcast: never overwritten
        report.claim(
            "default_rank0_same_as_without_sync",
            (mine - running_stats(no_sync_model)).abs().max(),
            "==",
            0.0,
            "rank 0's running statistics equal those of the forward_sync_buffers=False "
            "run: {value:.1e}",
        )
        if info.world_size > 1:  # one rank's batch IS the global batch: nothing to differ from
            gap = (mine - running_stats(tracker)).abs().max()
            report.claim(
                "default_rank0_differs_from_global_batch",
                gap,
                ">=",
                DRIFT,
                "... and differ from the global batch's (tracked) by {value:.2e}",
            )
    with (
        count_buffer_broadcasts() as sent
    ):  # evaluate THROUGH the wrapper: 3 forwards of 128 under no_grad
        acc = gather_to_rank0(local_accuracy(model, test_set), info)
    report.claim(
        "broadcasts_per_evaluation",
        len(sent),
        "==",
        1,
        "evaluation, 3 forwards under no_grad: "
        "{value} broadcast (the first: the forward before it synced gradients; no_grad ones do not)",
    )
    after = nan_max(
        spread(gather_stats(raw_model, info), channels)
    )  # the larger of mean and var's spread
    report.claim(
        "default_stats_equal_after_eval",
        after,
        "==",
        0.0,
        "spread of running statistics between "
        "ranks after it: {value:.1e} (all hold rank 0's: hidden)",
    )
    if acc:
        report.claim(
            "default_accuracy_identical",
            max(acc) - min(acc),
            "==",
            0.0,
            f"test accuracy {acc[0]:.4f} on every rank (spread {{value}}): rank 0's model "
            "everywhere",
        )
    broadcasts_after_eval(model, loader, info, report)


def broadcasts_after_eval(model, loader, info, report: Report) -> None:
    """3, continued: the training step after an evaluation sends nothing; under no_sync, one per step."""

    def micro_step(
        x, y, sync: bool
    ) -> None:  # forward + backward; no optimizer: only the broadcasts matter
        with nullcontext() if sync else model.no_sync():
            F.cross_entropy(model(x.to(info.device)), y.to(info.device)).backward()

    data = batches(loader, 7)
    with count_buffer_broadcasts() as sent:  # the training step after the evaluation
        micro_step(*next(data), sync=True)
    report.claim(
        "broadcasts_first_step_after_eval",
        len(sent),
        "==",
        0,
        "first training step after it: {value} broadcasts (the forward before it ran under no_grad)",
    )
    with (
        count_buffer_broadcasts() as sent
    ):  # 2 optimizer steps of 3 micro-steps, no_sync on the first 2
        for micro, (x, y) in enumerate(data):
            micro_step(x, y, sync=micro % 3 == 2)
    report.claim(
        "broadcasts_per_accumulation_step",
        len(sent) / 2,
        "==",
        1,
        f"2 optimizer steps of 3 "
        f"micro-steps, no_sync on 2: {len(sent)} broadcasts ({{value:g}} per optimizer step, at its "
        "first micro-step)",
    )


if __name__ == "__main__":
    run_main(main)
