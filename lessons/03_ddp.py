"""Lesson 03: DistributedDataParallel (DDP) -- lesson 01's training loop on several processes.

Run it:

    python lessons/03_ddp.py                                        # one process, no process group
    torchrun --standalone --nproc_per_node=2 lessons/03_ddp.py      # 2 processes (2 GPUs, or 2 CPU processes)
    torchrun --standalone --nproc_per_node=2 lessons/03_ddp.py --check-equivalence
    torchrun --standalone --nproc_per_node=2 lessons/03_ddp.py --checkpoint ckpt.pt --epochs 2
    torchrun --standalone --nproc_per_node=2 lessons/03_ddp.py --checkpoint ckpt.pt --epochs 3 --resume

    # two nodes, 2 processes each (a world of 4): the same command on both; $HOST0 is one node's address
    torchrun --nnodes=2 --nproc_per_node=2 \\
        --rdzv-backend=c10d --rdzv-endpoint=$HOST0:29500 --rdzv-id=lessons lessons/03_ddp.py

What to look for:
- The diff from lesson 01 is small: a process group, a DistributedSampler with set_epoch, the DDP wrap, metrics
  reduced over ranks, and rank-0-only printing and saving.
- "--batch-size" is per process: with 2 processes the global batch is 2 x 32 = 64, lesson 01's batch.
- The per-rank table: RANK is global, LOCAL_RANK picks the device on each node; only global rank 0 writes.
- "max parameter difference across ranks: 0": there is no parameter server and no rank that averages
  gradients and broadcasts updated weights. DDP copies rank 0's parameters and buffers to every rank ONCE, when
  it wraps the model; after that only gradients travel (all-reduced in buckets during backward), every rank
  applies the same averaged gradient, and the replicas stay identical without sending parameters again.
  (One exception, on by default: broadcast_buffers=True copies rank 0's BatchNorm running statistics to every
  rank before each forward; lesson 05 shows why and what that hides.)
- --check-equivalence: one process replays the same global batches and the DDP parameters match it (< 1e-5).
  Because BatchNorm normalises each rank's batch with that rank's statistics, the replay forwards each rank's
  chunk separately; a plain one-process run with --batch-size 64 would differ in its BatchNorm statistics.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from common.checkpoint import load_checkpoint, save_checkpoint, write_results
from common.data import digits_split, synthetic_split
from common.ranks import (gather_to_rank0, global_mean, max_param_diff_across_ranks, peak_rss_mb, print0,
                          rank0_progress)
from common.session import LessonError, add_distributed_args, barrier, distributed_session, run_main, set_seed
from common.metrics import evaluate
from common.models import DigitsCNN


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=4, help="passes over the training set (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per process per step; the global batch "
                   "is batch-size x world_size (default %(default)s)")
    p.add_argument("--lr", type=float, default=0.02, help="SGD learning rate (default %(default)s)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0, help="model init and data order (same on every rank)")
    p.add_argument("--data", default=None, help="digits .npz (default: the bundled data/digits.npz)")
    p.add_argument("--dataset", choices=["digits", "synthetic"], default="digits",
                   help="synthetic: class templates + noise, bigger images, for scaling benchmarks")
    p.add_argument("--image-size", type=int, default=32, help="synthetic images are 1 x N x N (default %(default)s)")
    p.add_argument("--synthetic-samples", type=int, default=4096, help="train + test samples (default %(default)s)")
    p.add_argument("--checkpoint", default=None, help="write a checkpoint here after every epoch")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--check-equivalence", action="store_true",
                   help="replay the run in one process on the global batches and compare parameters")
    p.add_argument("--results", default=None, help="rank 0 writes the reported numbers here as JSON")
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validate before any process group exists: every rank sees the same argv, so every rank fails alike.
    if args.batch_size < 1:
        raise LessonError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.epochs < 0:
        raise LessonError(f"--epochs must be >= 0, got {args.epochs}")
    if args.lr <= 0:
        raise LessonError(f"--lr must be positive, got {args.lr}")
    if args.dataset == "synthetic" and (args.image_size < 2 or args.image_size % 2 or args.synthetic_samples < 2):
        raise LessonError("--image-size must be an even number >= 2 and --synthetic-samples >= 2")
    if args.resume and not args.checkpoint:
        raise LessonError("--resume needs --checkpoint PATH")
    if args.resume and args.check_equivalence:
        raise LessonError("--check-equivalence replays a run from its start; it cannot follow --resume")
    return args


def replay_on_one_process(train_set, world_size: int, args, device) -> torch.nn.Module:
    """Train from the same initial weights in ONE process, on the same global batches DDP saw.

    At each step the global batch is the concatenation of every rank's batch. BatchNorm normalises each rank's
    batch with that rank's own statistics (lesson 05), so the replay forwards each rank's chunk separately;
    the loss is still the mean over all batch-size x world_size samples, which is what DDP's averaged
    gradient is the gradient of.
    """
    set_seed(args.seed)
    model = DigitsCNN(image_size=train_set.tensors[0].shape[-1]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    samplers = [DistributedSampler(train_set, num_replicas=world_size, rank=r, shuffle=True, seed=args.seed)
                for r in range(world_size)]
    for epoch in range(args.epochs):
        for s in samplers:
            s.set_epoch(epoch)
        loaders = [DataLoader(train_set, batch_size=args.batch_size, sampler=s) for s in samplers]
        for chunks in zip(*loaders):  # chunks[r] = (x, y) that rank r trained on at this step
            losses = [F.cross_entropy(model(x.to(device)), y.to(device)) for x, y in chunks]
            loss = torch.stack(losses).mean()  # equal chunk sizes: mean of means = global mean
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return model


def main() -> None:
    args = parse_args()
    with distributed_session(args) as info:
        # Same seed on every rank -> same initial weights. (DDP also broadcasts rank 0's parameters and buffers
        # when it wraps the model, so a rank with a different seed would be overwritten there, once.)
        set_seed(args.seed)
        if args.dataset == "digits":
            train_set, test_set = digits_split(path=args.data)  # (1438, 1, 8, 8) and (359, 1, 8, 8), every rank
            image_size = 8
        else:
            train_set, test_set = synthetic_split(args.synthetic_samples, args.image_size, seed=args.seed)
            image_size = args.image_size

        # Each rank reads a disjoint 1/world_size of a permutation that depends on (seed, epoch): 1438 / 2 = 719
        # samples, 23 batches of 32 per rank per epoch with 2 processes.
        sampler = DistributedSampler(train_set, num_replicas=info.world_size, rank=info.rank,
                                     shuffle=True, seed=args.seed)
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

        # Wrap order: build -> .to(device) -> DDP. DDP registers its all-reduce hooks on the parameters it
        # finds, which must already be on this rank's device. `raw_model` is what we save and load.
        raw_model = DigitsCNN(image_size=image_size).to(info.device)
        model = raw_model
        if info.distributed:
            model = DDP(raw_model, device_ids=[info.local_rank] if info.device.type == "cuda" else None)
        optimizer = torch.optim.SGD(raw_model.parameters(), lr=args.lr, momentum=args.momentum)

        start_epoch = 0
        if args.resume:
            ckpt = load_checkpoint(args.checkpoint, info.device)  # map_location = this rank's device
            raw_model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            start_epoch = int(ckpt["epoch"])
            print0(f"resumed from {args.checkpoint} at epoch {start_epoch}")

        print0(f"world_size {info.world_size}  backend {info.backend or 'none'}  device {info.device.type}  "
               f"global batch {args.batch_size * info.world_size} ({info.world_size} x {args.batch_size})")
        history, steps, wrote_checkpoint, samples_per_s = [], 0, False, []
        for epoch in range(start_epoch, args.epochs):
            sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
            first_indices = list(sampler)[:8]  # recorded to show: a new order each epoch, the same on rerun
            model.train()
            loss_sum, seen = 0.0, 0
            if info.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for x, y in rank0_progress(loader, info, desc=f"epoch {epoch + 1}"):
                x, y = x.to(info.device), y.to(info.device)  # x (B, 1, 8, 8) for digits, y (B,); B = 32
                loss = F.cross_entropy(model(x), y)  # mean over this rank's B samples
                optimizer.zero_grad(set_to_none=True)
                # DDP groups gradients into buckets (the first ~1 MB, then up to 25 MB each: bucket_cap_mb) and
                # all-reduces each bucket, averaged over ranks, as soon as backward has filled it.
                loss.backward()
                optimizer.step()  # every rank applies the same averaged gradient: no broadcast needed
                loss_sum += loss.item() * len(y)
                seen += len(y)
                steps += 1
            if info.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            # Reduce (sum, count) pairs over ranks, then divide once.
            train_loss = global_mean(loss_sum, seen, info)
            test = evaluate(model, test_set, info)
            history.append({"epoch": epoch + 1, "train_loss": train_loss, "test_loss": test["loss"],
                            "test_accuracy": test["accuracy"], "rank0_first_indices": first_indices})
            print0(f"epoch {epoch + 1}/{args.epochs}  train_loss {train_loss:.4f}  test_loss {test['loss']:.4f}  "
                   f"test_acc {test['accuracy']:.4f}")
            global_samples = seen * info.world_size  # every rank saw the same count (DistributedSampler pads)
            samples_per_s.append(global_samples / elapsed)
            print0(f"[perf] epoch {epoch + 1}: {elapsed:.2f} s, {global_samples / elapsed:.0f} samples/s over all ranks")
            if args.checkpoint:
                state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}
                wrote_checkpoint |= save_checkpoint(state, args.checkpoint, info)  # rank 0 writes, all wait

        # Since the wrap no rank sent parameters to another, yet they are identical: same start, same averaged
        # gradients, same optimizer step. (Parameters only: BatchNorm buffers are rank 0's copies, see docstring.)
        max_diff = max_param_diff_across_ranks(raw_model, info)
        final = evaluate(model, test_set, info)
        facts = gather_to_rank0({"rank": info.rank, "local_rank": info.local_rank, "device": str(info.device),
                                 "steps": steps, "wrote_checkpoint": wrote_checkpoint,
                                 "peak_rss_mb": peak_rss_mb()}, info)
        print0(f"{'rank':>4} {'local_rank':>10} {'device':>8} {'steps':>5}  wrote_checkpoint")
        for f in facts or []:
            print0(f"{f['rank']:>4} {f['local_rank']:>10} {f['device']:>8} {f['steps']:>5}  "
                   f"{'yes' if f['wrote_checkpoint'] else 'no'}")
        if info.distributed:
            print0(f"max parameter difference across ranks: {max_diff:.1e}")
        else:
            print0("max parameter difference across ranks: n/a (one process, no process group)")
        print0(f"final test_loss {final['loss']:.4f}  test_acc {final['accuracy']:.4f}  "
               f"(on {final['count']} test images, each counted once)")
        rss = ", ".join(f"{f['peak_rss_mb']:.0f}" for f in facts or [])
        print0(f"[perf] peak RSS per rank (MB): {rss}")

        results = {"world_size": info.world_size, "backend": info.backend, "device": info.device.type,
                   "batch_size_per_process": args.batch_size, "global_batch_size": args.batch_size * info.world_size,
                   "history": history, "final_test_loss": final["loss"], "final_test_accuracy": final["accuracy"],
                   "test_count": final["count"], "max_param_diff_across_ranks": max_diff, "ranks": facts,
                   "samples_per_s": samples_per_s}
        if args.check_equivalence:
            if info.master_process:
                reference = replay_on_one_process(train_set, info.world_size, args, info.device)
                diff = max((p - q).abs().max().item() for p, q in zip(raw_model.parameters(),
                                                                      reference.parameters()))
                results["equivalence_max_abs_diff"] = diff
                print0(f"DDP on {info.world_size} ranks vs one process on the global batch: "
                       f"max |parameter difference| = {diff:.1e} ({'<' if diff < 1e-5 else '>='} 1e-5)")
            barrier(info)  # the other ranks wait (within --timeout-s) while rank 0 replays
        write_results(args.results, results, info)


if __name__ == "__main__":
    run_main(main)
