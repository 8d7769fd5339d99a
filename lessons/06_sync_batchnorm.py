"""Lesson 05: SyncBatchNorm -- BatchNorm statistics over the global batch, and a SyncBatchNorm built from collectives.

Run it:

    python lessons/05_sync_batchnorm.py                                       # one process: both variants agree
    torchrun --standalone --nproc_per_node=4 lessons/05_sync_batchnorm.py     # 4 processes x 4 samples per step
    torchrun --standalone --nproc_per_node=4 lessons/05_sync_batchnorm.py --group-size 2   # sync {0,1} and {2,3}
    torchrun --standalone --nproc_per_node=2 lessons/05_sync_batchnorm.py --batch-size 2 --sync-impl scratch

What to look for:
- Under DDP every process runs its own copy of the model, so a plain BatchNorm normalises with the statistics of
  THIS rank's micro-batch (4 samples here, not the global 16) and updates THIS rank's running mean and variance.
  DDP averages gradients but never the BatchNorm buffers (with forward_sync_buffers=False, see below): the table
  "running-stat spread between ranks" shows the BatchNorm replicas drift apart, so the model you save from rank 0
  is not the one rank 3 evaluates with, and per-rank test accuracies can differ (they do in the notebook's 40-step run).
- SyncBatchNorm computes mean and variance over the global batch (one collective per layer in forward -- an
  all-gather of per-rank statistics in torch's nn.SyncBatchNorm, an all-reduce of sums in ours -- and one in
  backward): its running statistics are identical on every rank (spread 0).
- Which SyncBatchNorm ran: `torch.nn.SyncBatchNorm` on CUDA; on CPU (where in torch 2.13 its forward raises and
  DDP refuses it) the from-scratch `common.sync_batchnorm.SyncBatchNorm`, which tests prove equal to BatchNorm on
  the concatenated global batch and to nn.SyncBatchNorm on CUDA.
- convert_sync_batchnorm swaps the BatchNorm children of the model you pass IN PLACE and must run BEFORE the DDP
  wrap (DDP records the parameters and buffers it finds when it is built).
- --group-size 2 at world size 4: statistics are synchronised within {0,1} and within {2,3} (spread 0 inside a
  group, not between groups), the usual way to keep the all-reduce inside one node.
- "collectives per step": BatchNorm layers make 0; SyncBatchNorm makes one per layer in forward and one per
  layer in backward (2 + 2 for this CNN), on top of DDP's gradient bucket all-reduce(s).
- [perf] step-time ratio SyncBatchNorm / BatchNorm, measured in this run.

Why DDP(..., forward_sync_buffers=False) (torch 2.13's replacement for broadcast_buffers=False; unlike the old flag it
still broadcasts the buffers once, when DDP is built): DDP's default copies rank
0's buffers to every rank before each forward. That hides the drift (rank 0's running statistics overwrite the
others) without fixing it: they remain statistics of rank 0's micro-batches only. We turn it off for both variants
so the lesson measures what each rank computes. (Buffers are still broadcast once when DDP is built; all ranks
start from the same seed, so that changes nothing here.)
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from common.checkpoint import write_results
from common.data import digits_split
from common.ranks import gather_to_rank0, max_param_diff_across_ranks, print0
from common.session import (LessonError, add_distributed_args, choose_backend_and_device, distributed_session,
                            read_torchrun_env, run_main, set_seed)
from common.counters import CommCounter
from common.models import DigitsCNN
from common.counters import count_collectives
from common.sync_batchnorm import batchnorm_modules, convert_sync_batchnorm, running_stats

VARIANTS = ("batchnorm", "syncbn")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=1, help="passes over the training set (default %(default)s)")
    p.add_argument("--max-steps", type=int, default=60,
                   help="stop each variant after this many steps, 0 = no limit (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=4, help="samples per process per step (small on purpose); "
                   "the global batch is batch-size x world_size (default %(default)s)")
    p.add_argument("--lr", type=float, default=0.02, help="SGD learning rate (default %(default)s)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0, help="model init and data order (same on every rank)")
    p.add_argument("--data", default=None, help="digits .npz (default: the bundled data/digits.npz)")
    p.add_argument("--sync-impl", choices=["auto", "torch", "scratch"], default="auto",
                   help="SyncBatchNorm to use: torch's nn.SyncBatchNorm (CUDA only), the from-scratch one, or "
                   "auto = torch on CUDA, scratch on CPU")
    p.add_argument("--group-size", type=int, default=0,
                   help="synchronise within groups of this many consecutive ranks (0 = all ranks)")
    p.add_argument("--log-every", type=int, default=10, help="measure the running-stat spread every N steps")
    p.add_argument("--results", default=None, help="rank 0 writes the reported numbers here as JSON")
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validate before any process group exists: every rank sees the same argv and environment, so all fail alike.
    if args.batch_size < 1:
        raise LessonError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.epochs < 1:
        raise LessonError(f"--epochs must be >= 1, got {args.epochs}")
    if args.max_steps < 0 or args.log_every < 1:
        raise LessonError("--max-steps must be >= 0 and --log-every >= 1")
    if args.lr <= 0:
        raise LessonError(f"--lr must be positive, got {args.lr}")
    _, local_rank, world_size, local_world_size = read_torchrun_env()
    _, device = choose_backend_and_device(args.backend, args.device, local_rank, local_world_size)
    if args.sync_impl == "auto":
        args.sync_impl = "torch" if device.type == "cuda" else "scratch"
    if args.sync_impl == "torch" and device.type != "cuda":
        raise LessonError("--sync-impl torch: nn.SyncBatchNorm runs on GPUs only in torch 2.13 (its forward "
                          "raises on CPU); use --sync-impl scratch or auto")
    if args.group_size < 0 or (args.group_size and world_size % args.group_size):
        raise LessonError(f"--group-size {args.group_size} must be 0 or divide the world size {world_size}")
    return args


def convert(model: nn.Module, impl: str, process_group) -> nn.Module:
    """BatchNorm -> SyncBatchNorm, PyTorch's or ours; both swap the children of `model` in place."""
    if impl == "torch":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group)
    return convert_sync_batchnorm(model, process_group)


def gather_vector(t: torch.Tensor, info) -> torch.Tensor:
    """(world_size, n) float64 on CPU: every rank's copy of the vector t (n,), every rank gets all of them."""
    if not info.distributed:
        return t.double().cpu().unsqueeze(0)
    t = t.to(info.device, torch.float64)  # NCCL moves CUDA tensors only
    out = [torch.empty_like(t) for _ in range(info.world_size)]
    dist.all_gather(out, t)
    return torch.stack(out).cpu()


def spread(stats: torch.Tensor, n_means: list[int]) -> dict:
    """Largest difference between ranks, over every channel, of running means and of running variances.

    stats (world_size, sum 2C) as returned by running_stats on each rank; n_means gives C per layer.
    """
    diff = stats.max(0).values - stats.min(0).values  # (sum 2C,) max_r - min_r per entry
    means, variances, i = [], [], 0
    for c in n_means:
        means.append(diff[i:i + c])
        variances.append(diff[i + c:i + 2 * c])
        i += 2 * c
    return {"mean": torch.cat(means).max().item(), "var": torch.cat(variances).max().item()}


@torch.no_grad()
def test_accuracy(model: nn.Module, test_set, device) -> float:
    """Accuracy of THIS rank's model (its own running statistics) on the whole test set; no communication."""
    model.eval()
    x, y = test_set.tensors
    correct = (model(x.to(device)).argmax(1) == y.to(device)).sum().item()
    model.train()
    return correct / len(y)


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        train_set, test_set = digits_split(path=args.data)  # (1438, 1, 8, 8) and (359, 1, 8, 8), every rank
        sampler = DistributedSampler(train_set, num_replicas=info.world_size, rank=info.rank, shuffle=True,
                                     seed=args.seed)
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
        # Process groups: every rank must call new_group for EVERY group, even those it is not in.
        process_group, group_of = None, [0] * info.world_size
        if info.distributed and 0 < args.group_size < info.world_size:
            process_group, _ = dist.new_subgroups(group_size=args.group_size)
            group_of = [r // args.group_size for r in range(info.world_size)]
        impl_name = {"torch": "torch.nn.SyncBatchNorm",
                     "scratch": "common.sync_batchnorm.SyncBatchNorm (from scratch)"}[args.sync_impl]
        print0(f"world_size {info.world_size}  backend {info.backend or 'none'}  device {info.device.type}  "
               f"global batch {args.batch_size * info.world_size} ({info.world_size} x {args.batch_size})")
        print0(f"SyncBatchNorm implementation: {impl_name}")
        if args.group_size and info.world_size > 1:
            groups = sorted({tuple(r for r in range(info.world_size) if group_of[r] == g) for g in group_of})
            print0(f"SyncBatchNorm process groups: {' '.join('{' + ','.join(map(str, g)) + '}' for g in groups)}")

        results = {"world_size": info.world_size, "backend": info.backend, "device": info.device.type,
                   "sync_impl": args.sync_impl, "batch_size_per_process": args.batch_size,
                   "global_batch_size": args.batch_size * info.world_size, "group_size": args.group_size,
                   "group_of_rank": group_of, "variants": {}}
        for variant in VARIANTS:
            set_seed(args.seed)  # same initial weights and the same data order for both variants
            raw_model = DigitsCNN().to(info.device)
            n_means = [m.num_features for _, m in batchnorm_modules(raw_model)]
            if variant == "syncbn":
                # BEFORE the DDP wrap: DDP registers hooks on, and records, the modules it finds when built.
                before = [type(m).__name__ for _, m in batchnorm_modules(raw_model)]
                converted = convert(raw_model, args.sync_impl, process_group)
                after = [type(m).__name__ for _, m in batchnorm_modules(converted)]
                results["convert"] = {"same_object": converted is raw_model, "before": before, "after": after}
                print0(f"convert_sync_batchnorm: {', '.join(before)} -> {', '.join(after)}; "
                       f"returned the model passed in (swapped in place): {converted is raw_model}")
            model = raw_model
            comm = CommCounter()
            if info.distributed:
                # forward_sync_buffers=False: keep each rank's own running statistics (see the docstring).
                model = DDP(raw_model, device_ids=[info.local_rank] if info.device.type == "cuda" else None,
                            forward_sync_buffers=False)
                model.register_comm_hook(comm, CommCounter.hook)  # counts DDP's gradient all-reduces
            optimizer = torch.optim.SGD(raw_model.parameters(), lr=args.lr, momentum=args.momentum)

            steps, step_times, spread_curve, counts = 0, [], [], {}
            for epoch in range(args.epochs):
                sampler.set_epoch(epoch)
                for x, y in loader:
                    if args.max_steps and steps >= args.max_steps:
                        break
                    x, y = x.to(info.device), y.to(info.device)  # x (B, 1, 8, 8), B = batch-size on this rank
                    if info.device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    if steps == 0:  # count once: the numbers are the same at every step
                        comm.reset()
                        with count_collectives() as fwd:
                            loss = F.cross_entropy(model(x), y)
                        with count_collectives() as bwd:
                            optimizer.zero_grad(set_to_none=True)
                            loss.backward()  # SyncBN's backward all-reduces; DDP all-reduces gradient buckets
                        # The comm hook issues DDP's bucket all-reduces from Python too: take them out of the
                        # backward count so that "backward" is what the BatchNorm layers themselves call.
                        counts = {"forward": fwd.total, "backward": bwd.total - comm.calls,
                                  "ddp_buckets": comm.calls}
                    else:
                        loss = F.cross_entropy(model(x), y)
                        optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                    optimizer.step()
                    if info.device.type == "cuda":
                        torch.cuda.synchronize()
                    step_times.append(time.perf_counter() - t0)
                    steps += 1
                    if steps % args.log_every == 0:
                        spread_curve.append([steps, spread(gather_vector(running_stats(raw_model), info),
                                                           n_means)["mean"]])
            # Final per-rank statistics, all ranks' copies side by side: (world_size, 96) for this CNN.
            stats = gather_vector(running_stats(raw_model), info)
            s = spread(stats, n_means)
            within = across = 0.0
            if args.group_size and info.world_size > 1:
                for g in set(group_of):
                    members = [r for r in range(info.world_size) if group_of[r] == g]
                    within = max(within, spread(stats[members], n_means)["mean"])
                across = spread(stats[[min(r for r in range(info.world_size) if group_of[r] == g)
                                       for g in sorted(set(group_of))]], n_means)["mean"]
            acc = gather_to_rank0(test_accuracy(raw_model, test_set, info.device), info)
            max_param_diff = max_param_diff_across_ranks(raw_model, info)
            warm = step_times[min(5, len(step_times) - 1):]  # skip the first steps (allocation, counting)
            v = {"steps": steps, "final_loss": loss.item(), "spread_running_mean": s["mean"],
                 "spread_running_var": s["var"], "spread_within_groups": within, "spread_across_groups": across,
                 "spread_curve": spread_curve, "collectives_per_step": counts, "max_param_diff": max_param_diff,
                 "first_layer_running_mean": stats[:, :n_means[0]].tolist(), "test_accuracy_per_rank": acc,
                 "mean_step_s": sum(warm) / len(warm)}
            results["variants"][variant] = v
            if info.master_process:
                accs = " ".join(f"{a:.4f}" for a in acc)
                print0(f"{variant:>9}: {steps} steps  test_acc per rank {accs}  running-stat spread between ranks: "
                       f"mean {s['mean']:.2e} var {s['var']:.2e}")
                print0(f"{'':>9}  collectives per step: forward {counts.get('forward', 0)}, backward "
                       f"{counts.get('backward', 0)} (BatchNorm layers) + {counts.get('ddp_buckets', 0)} DDP "
                       f"gradient all-reduce(s); max parameter difference across ranks {max_param_diff:.1e}")
                if args.group_size and info.world_size > 1:
                    print0(f"{'':>9}  running-mean spread within groups {within:.2e}, across groups {across:.2e}")
        ratio = results["variants"]["syncbn"]["mean_step_s"] / results["variants"]["batchnorm"]["mean_step_s"]
        results["step_time_ratio"] = ratio
        print0(f"[perf] mean step time: BatchNorm {results['variants']['batchnorm']['mean_step_s'] * 1e3:.2f} ms, "
               f"SyncBatchNorm {results['variants']['syncbn']['mean_step_s'] * 1e3:.2f} ms, ratio {ratio:.2f}")
        write_results(args.results, results, info)


if __name__ == "__main__":
    run_main(main)
