"""Lesson 03: DistributedDataParallel (DDP) -- lesson 01's training loop on several processes.

Run it:

    python lessons/03_ddp.py                                        # one process, no process group
    torchrun --standalone --nproc_per_node=2 lessons/03_ddp.py      # 2 processes (2 GPUs, or 2 CPU processes)
    torchrun --standalone --nproc_per_node=2 lessons/03_ddp.py --check-equivalence
    torchrun --standalone --nproc_per_node=4 lessons/03_ddp.py --lr-scaling linear      # lr x global/32
    torchrun --standalone --nproc_per_node=2 lessons/03_ddp.py --checkpoint ckpt.pt --epochs 2
    torchrun --standalone --nproc_per_node=2 lessons/03_ddp.py --checkpoint ckpt.pt --epochs 3 --resume
    python lessons/03_ddp.py --spawn 2                              # the same training, started by mp.spawn
    python -m torch.distributed.launch --nproc_per_node=2 lessons/03_ddp.py   # the deprecated launcher

    # two nodes, 2 processes each (a world of 4): the same command on both; $HOST0 is one node's address
    torchrun --nnodes=2 --nproc_per_node=2 \\
        --rdzv-backend=c10d --rdzv-endpoint=$HOST0:29500 --rdzv-id=lessons lessons/03_ddp.py

What to look for:
- The diff from lesson 01: a process group, a DistributedSampler with set_epoch, the DDP wrap, metrics reduced
  over ranks, rank-0-only printing and saving. "--batch-size" is per process: 2 x 32 = 64 global. In the
  per-rank table RANK is global, LOCAL_RANK picks the device on each node; only global rank 0 writes.
- "max parameter difference across ranks: 0": no parameter server. DDP copies rank 0's parameters and buffers
  to every rank ONCE, when it wraps the model; then only gradients travel (all-reduced in buckets during
  backward), every rank applies the same averaged gradient and the PARAMETERS stay identical. One exception,
  on by default: `forward_sync_buffers=True` (`broadcast_buffers` before torch 2.13) broadcasts rank 0's
  buffers (BatchNorm's running statistics) at the start of a forward, but only if the previous forward ran
  with gradient sync: after a forward under `no_grad` or `no_sync` the next one sends nothing
  (`require_forward_param_sync`). Training sends them once per step, before its forward: each rank's last step
  leaves its own statistics.
- --check-equivalence: rank 0 replays the same global batches in one process; the parameters match (<= 1e-5)
  on 1-2 ranks; on 3+ ranks float32 sums in another order drift apart, printed without a claim (ORDER_NOTE).
  The other ranks wait for this rank-0-only phase without the --timeout-s bound
  (common.harness.session.rank0_only).

Learning rate and the global batch: one --lr on 1, 2 and 4 processes means global batches of 32, 64, 128 and
45, 23, 12 steps per epoch: first-epoch train loss 0.84, 1.27, 1.85, test loss after 4 epochs 0.015, 0.059,
0.073. The linear scaling rule (Goyal et al. 2017, arXiv:1706.02677), `--lr-scaling linear`: lr = --lr x
global batch / --base-batch; first epoch 1.04 on 2, 1.28 on 4 processes. Its warm-up (--warmup-steps, from
--lr up) matters when the scaled lr is large: --lr 0.05 on 4 processes (lr 0.2), first epoch 3.28 without,
1.64 with 12 warm-up steps.

Launchers (docs/launchers.md): torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, runs the
rendezvous across nodes and restarts EVERY rank when one fails (--max-restarts=N, default 0). mp.spawn
(--spawn N) calls fn(rank, *args) in N fresh interpreters; fn must be importable (notebook 03). `python -m
torch.distributed.launch` (deprecated) passes --local-rank=N: accepted, with a note. nn.DataParallel is ONE
process driving every GPU with threads; PyTorch recommends DDP even on one machine, and without GPUs
DataParallel just calls the module (measured below). Sources:
https://pytorch.org/docs/stable/notes/ddp.html, https://pytorch.org/docs/stable/notes/cuda.html,
https://pytorch.org/docs/stable/elastic/run.html
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from common.data import digits_split, synthetic_split
from common.data_parallel.references import dataparallel_difference, replay_on_one_process
from common.harness.atomic import load_checkpoint, save_checkpoint
from common.harness.env import DistInfo, LessonError
from common.harness.metrics import evaluate
from common.harness.ranks import (
    gather_to_rank0,
    global_mean,
    max_param_diff_across_ranks,
    peak_rss_mb,
    print0,
    rank0_progress,
)
from common.harness.results import Report
from common.harness.session import (
    add_distributed_args,
    distributed_session,
    rank0_only,
    run_main,
    set_seed,
)
from common.harness.spawn import spawn_world
from common.measure.differences import max_abs_diff_all
from common.models import DigitsCNN


def add_data_args(p: argparse.ArgumentParser) -> None:
    """Where the samples come from: the bundled digits, or synthetic images for the benchmarks."""
    p.add_argument("--data", default=None, help="digits .npz (default: data/digits.npz)")
    p.add_argument("--dataset", choices=["digits", "synthetic"], default="digits")
    p.add_argument("--image-size", type=int, default=32, help="synthetic images are 1 x N x N")
    p.add_argument("--synthetic-samples", type=int, default=4096, help="synthetic train + test")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=4, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=32, help="samples per process per step")
    p.add_argument("--lr", type=float, default=0.02, help="SGD learning rate (default %(default)s)")
    p.add_argument(
        "--lr-scaling",
        choices=["none", "linear"],
        default="none",
        help="linear: lr x global batch / --base-batch",
    )
    p.add_argument("--base-batch", type=int, default=32, help="the global batch --lr is tuned for")
    p.add_argument("--warmup-steps", type=int, default=0, help="ramp the lr up from --lr")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0, help="init and data order (every rank)")
    add_data_args(p)
    p.add_argument("--checkpoint", default=None, help="write a checkpoint here after every epoch")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--check-equivalence", action="store_true", help="rank 0 replays the run alone")
    p.add_argument("--spawn", type=int, default=0, metavar="N", help="N processes by mp.spawn")
    p.add_argument("--results", default=None, help="rank 0 writes the reported numbers here (JSON)")
    add_distributed_args(p)
    args = p.parse_args(argv)
    # Validate before any process group exists: every rank sees the same argv, so every rank fails alike.
    if args.batch_size < 1 or args.base_batch < 1:
        raise LessonError(
            f"--batch-size must be a positive integer, got {args.batch_size} (--base-batch too)"
        )
    for name in ("epochs", "warmup_steps", "spawn"):
        if getattr(args, name) < 0:
            raise LessonError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.lr <= 0:
        raise LessonError(f"--lr must be positive, got {args.lr}")
    bad_size = args.image_size < 2 or args.image_size % 2 or args.synthetic_samples < 2
    if args.dataset == "synthetic" and bad_size:
        raise LessonError("--image-size must be an even number >= 2 and --synthetic-samples >= 2")
    if args.resume and not args.checkpoint:
        raise LessonError("--resume needs --checkpoint PATH")
    if args.resume and args.check_equivalence:
        raise LessonError("--check-equivalence replays a run from its start: not after --resume")
    if args.spawn and "RANK" in os.environ:
        raise LessonError("--spawn starts its own processes: run it with plain python")
    return args


def lr_at(step: int, args: argparse.Namespace, world_size: int) -> float:
    """The learning rate of optimizer step `step` (0-based): --lr, or the linear scaling rule with warm-up."""
    scale = 1.0
    if args.lr_scaling == "linear":
        scale = args.batch_size * world_size / args.base_batch  # 4 x 32 / 32 = 4
    # the warm-up goes from 0 to 1 over --warmup-steps (Goyal et al., section 2.2)
    warm = min(1.0, step / args.warmup_steps) if args.warmup_steps else 1.0
    return args.lr + (args.lr * scale - args.lr) * warm  # from --lr up to --lr x scale


@dataclass
class Run:
    """What train and its checks share: the options, this rank, the report, the data and its
    sampler, the model (`raw_model` is what is saved, loaded and evaluated; `model` wraps it in
    DDP), and the epoch to start from."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    train_set: TensorDataset  # (1438, 1, 8, 8) images, their labels, on every rank
    test_set: TensorDataset  # (359, 1, 8, 8)
    sampler: DistributedSampler
    loader: DataLoader
    raw_model: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer
    start_epoch: int


def build(args: argparse.Namespace, info: DistInfo) -> Run:
    """Data, sampler, model (wrapped in DDP), optimizer, and the epoch a resume restores."""
    # Same seed on every rank -> same initial weights (DDP also copies rank 0's once, when it wraps it).
    set_seed(args.seed)
    if args.dataset == "digits":
        # (1438, 1, 8, 8) and (359, 1, 8, 8), on every rank
        train_set, test_set = digits_split(path=args.data)
    else:
        train_set, test_set = synthetic_split(
            args.synthetic_samples, args.image_size, seed=args.seed
        )

    # Each rank reads a disjoint 1/world_size of a permutation that depends on (seed, epoch): 1438 / 2 = 719
    # samples, 23 batches of 32 per rank per epoch with 2 processes.
    sampler = DistributedSampler(
        train_set, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=args.seed
    )
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    # Wrap order: build -> .to(device) -> DDP. DDP registers its all-reduce hooks on the parameters it
    # finds, which must already be on this rank's device. `raw_model` is what we save, load and evaluate.
    raw_model = DigitsCNN(image_size=train_set.tensors[0].shape[-1]).to(info.device)
    model = raw_model
    if info.distributed:  # forward_sync_buffers defaults to True: the docstring says when it sends
        model = DDP(raw_model, device_ids=[info.local_rank] if info.device.type == "cuda" else None)
    optimizer = torch.optim.SGD(raw_model.parameters(), lr=args.lr, momentum=args.momentum)

    start_epoch = 0
    if args.resume:
        ckpt = load_checkpoint(args.checkpoint, info.device)  # map_location = this rank's device
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = int(ckpt["epoch"])
        print0(f"resumed from {args.checkpoint} at epoch {start_epoch}")
    return Run(
        args,
        info,
        Report(info),
        train_set,
        test_set,
        sampler,
        loader,
        raw_model,
        model,
        optimizer,
        start_epoch,
    )


def save(raw_model: nn.Module, optimizer, epoch: int, path: str, info: DistInfo) -> bool:
    """Global rank 0 writes the unwrapped model, the optimizer and the epoch; every rank waits for it.
    Returns whether this rank wrote (temporary file + rename: a crash never leaves half a file)."""
    state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
    return save_checkpoint(state, path, info)


def report_setup(run: Run) -> None:
    """Who runs, on what, with which global batch and learning rate."""
    W, B = run.info.world_size, run.args.batch_size
    run.report.record("world_size", W)
    run.report.record("backend", run.info.backend)
    run.report.record("device", run.info.device.type)
    run.report.record("batch_size_per_process", B)
    run.report.value(
        "global_batch_size",
        W * B,
        "world_size {W}  backend {backend}  device {device}  global batch {value} ({W} x {B})",
        W=W,
        B=B,
        backend=run.info.backend or "none",
        device=run.info.device.type,
    )
    scaled = " on every world size (--lr-scaling none)"
    if run.args.lr_scaling == "linear":
        scaled = " = {lr:g} x {global_batch} / {base} (linear scaling), warm-up {warmup} steps"
    run.report.value(
        "lr",
        lr_at(10**9, run.args, W),
        "learning rate {value:g}" + scaled,
        lr=run.args.lr,
        global_batch=W * B,
        base=run.args.base_batch,
        warmup=run.args.warmup_steps,
    )


def train(args: argparse.Namespace, info: DistInfo) -> None:
    """The lesson: every rank runs this inside a process group (or alone, without one)."""
    run = build(args, info)
    report_setup(run)
    before = evaluate(run.raw_model, run.test_set, info)  # the untrained model: about ln(10) = 2.30
    history, steps, wrote_checkpoint, samples_per_s, test = [], 0, False, [], before
    # optimizer steps before this run: a resumed warm-up continues where it stopped
    step0 = run.start_epoch * len(run.loader)
    sync = torch.cuda.synchronize if info.device.type == "cuda" else (lambda: None)
    model = run.model  # DDP's wrapper around run.raw_model
    optimizer = run.optimizer  # SGD on the raw model's parameters: the tensors DDP syncs
    for epoch in range(run.start_epoch, args.epochs):
        run.sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
        # recorded: a new order each epoch, the same on a rerun
        first_indices = list(run.sampler)[:8]
        model.train()
        loss_sum, seen = 0.0, 0
        sync()
        t0 = time.perf_counter()
        for x, y in rank0_progress(run.loader, info, desc=f"epoch {epoch + 1}"):
            x, y = x.to(info.device), y.to(info.device)  # x (B, 1, 8, 8) for digits, y (B,); B = 32
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step0 + steps, args, info.world_size)
            loss = F.cross_entropy(model(x), y)  # mean over this rank's B samples
            optimizer.zero_grad(set_to_none=True)
            # DDP all-reduces (averages) each gradient bucket as soon as backward has filled it (default
            # bucket_cap_mb=25: the first bucket ~1 MB, then up to 25 MB each)
            loss.backward()
            optimizer.step()  # every rank applies the same averaged gradient: no broadcast needed
            loss_sum, seen, steps = loss_sum + loss.item() * len(y), seen + len(y), steps + 1
        sync()  # GPU work is asynchronous: wait before reading the clock
        # every rank saw the same count (DistributedSampler pads)
        samples_per_s.append(seen * info.world_size / (time.perf_counter() - t0))
        train_loss = global_mean(loss_sum, seen, info)  # (sum, count) over ranks, divided once
        test = evaluate(run.raw_model, run.test_set, info)  # the unwrapped model, over ranks
        row = {"epoch": epoch + 1, "train_loss": train_loss, "test_loss": test["loss"]}
        history.append(
            {**row, "test_accuracy": test["accuracy"], "rank0_first_indices": first_indices}
        )
        print0(
            f"epoch {epoch + 1}/{args.epochs}  train_loss {train_loss:.4f}  test_loss {test['loss']:.4f}  "
            f"test_acc {test['accuracy']:.4f}"
        )
        if args.checkpoint:
            wrote_checkpoint |= save(run.raw_model, optimizer, epoch + 1, args.checkpoint, info)
    run.report.record("history", history)
    # per epoch, over all ranks (benchmarks/ddp_scaling.py)
    run.report.record("samples_per_s", samples_per_s)
    report_claims(run, {"steps": steps, "wrote_checkpoint": wrote_checkpoint}, test, before)
    compare_with_dataparallel(run)
    if args.check_equivalence:
        check_equivalence(run)
    run.report.finish(args.results)


def print_ranks(args, facts: list[dict]) -> None:
    """Rank 0 prints every rank's facts, in rank order (raw prints from several ranks interleave)."""
    wrote = "  wrote the checkpoint" if args.checkpoint else ""
    print0(f"{'rank':>4} {'local_rank':>10} {'device':>8} {'steps':>5}{wrote}")
    for f in facts:
        wrote = f"  {'yes' if f['wrote_checkpoint'] else 'no'}" if args.checkpoint else ""
        print0(f"{f['rank']:>4} {f['local_rank']:>10} {f['device']:>8} {f['steps']:>5}{wrote}")
    if not args.checkpoint:
        print0(
            "(no --checkpoint given: no rank wrote one; with --checkpoint PATH only global rank 0 writes)"
        )


def report_claims(run: Run, mine: dict, test: dict, before: dict) -> None:
    """Every rank's facts (printed by rank 0 in rank order), then the run's claims: `mine` holds this rank's
    steps and whether it wrote the checkpoint, `test` and `before` the last and the first evaluation."""
    here = {
        "rank": run.info.rank,
        "local_rank": run.info.local_rank,
        "device": str(run.info.device),
    }
    facts = gather_to_rank0({**here, **mine, "peak_rss_mb": peak_rss_mb()}, run.info) or []
    print_ranks(run.args, facts)
    run.report.record("ranks", facts)
    # no rank sent parameters since the wrap, yet: same start, same gradients, same step
    if run.info.distributed:
        run.report.claim(
            "replicas_identical",
            max_param_diff_across_ranks(run.raw_model, run.info),
            "==",
            0.0,
            "max parameter difference across ranks: {value:.1e} (no parameter server)",
        )
    ratio = test["loss"] / before["loss"]
    sentence = "test loss {start:.4f} at this run's start -> {end:.4f}: ratio {value:.3f}"
    losses = {"start": before["loss"], "end": test["loss"]}
    if mine["steps"] >= 40:  # a run of this length halves the test loss; a shorter one need not:
        run.report.claim("loss_falls", ratio, "<=", 0.5, sentence, **losses)
    else:  # 4 ranks x 1 epoch = 12 steps end at 0.83; a resumed run starts trained
        note = " (no claim: {steps} steps, it needs 40)"
        run.report.value("loss_ratio", ratio, sentence + note, steps=mine["steps"], **losses)
    # the bound is for the default 4 epochs (shorter runs print test_acc per epoch only)
    if run.args.epochs >= 4:
        run.report.claim(
            "test_accuracy", test["accuracy"], ">=", 0.95, "final test accuracy {value:.4f}"
        )
    run.report.claim(
        "each_test_image_counted_once",
        test["count"],
        "==",
        len(run.test_set),
        "test images counted over all ranks: {value} (the padded repeats dropped)",
    )
    run.report.perf(
        "peak_rss_mb",
        [f["peak_rss_mb"] for f in facts],
        "peak RSS per rank (MB): {mb}",
        mb=", ".join(f"{f['peak_rss_mb']:.0f}" for f in facts),
    )


def compare_with_dataparallel(run: Run) -> None:
    """nn.DataParallel (one process, threads) on rank 0: its output equals the module's."""
    with rank0_only(run.info, "the DataParallel comparison") as mine:
        if mine:
            print0(
                "nn.DataParallel, the older API DDP replaces: ONE process drives every GPU with threads "
                "(docs/launchers.md)"
            )
            x = run.test_set.tensors[0].to(run.info.device)  # (359, 1, 8, 8)
            device_ids, diff = dataparallel_difference(run.raw_model, x)
            run.report.record("dataparallel_device_ids", device_ids)
            run.report.claim(
                "dataparallel_output_equals_module",
                diff,
                "<=",
                1e-5,
                "nn.DataParallel on device_ids {ids} vs the module itself: "
                "max |output difference| = {value:.1e}",
                ids=device_ids,
            )


# Why the equality is claimed on 1-2 ranks only. DDP averages the ranks' gradients in the backend's order, the
# replay in autograd's. With 2 ranks both compute (g0 + g1) / 2 exactly alike (a sum of two does not depend on
# the order, and halving is exact in floating point). With 3+ ranks the sums round differently in the last
# bit, and training amplifies it, by jumps once a max-pool or ReLU decision flips: on 4 ranks at lr 0.08 the
# parameters were 1.2e-7 apart after epochs 1-2, 2.7e-7 after 3, 2.4e-4 after 4 and 1.2e-1 after 12 (one CPU;
# another CPU rounds elsewhere). Both runs are correct: two float32 runs of one algorithm drift like this.
ORDER_NOTE = " (3+ ranks: float32 sums in another order, no claim; see ORDER_NOTE in the code)"


def check_equivalence(run: Run) -> None:
    """--check-equivalence: rank 0 replays the run in one process; the parameters match."""
    # the other ranks wait for this rank-0-only phase without the --timeout-s bound
    with rank0_only(run.info, "the one-process replay") as mine:
        if mine:
            t0 = time.perf_counter()
            reference, _ = replay_on_one_process(
                run.train_set, run.info.world_size, run.args, run.info.device, lr_at
            )
            run.report.perf(
                "replay_s", time.perf_counter() - t0, "one-process replay: {value:.2f} s"
            )
            ddp, replay = list(run.raw_model.parameters()), list(reference.parameters())
            diff = max_abs_diff_all(ddp, replay)  # NaN-safe: a diverged run fails the claim
            sentence = (
                "DDP on {ranks} ranks vs one process on the global batch: "
                "max |parameter difference| = {value:.1e}"
            )
            if run.info.world_size <= 2:
                run.report.claim(
                    "ddp_equals_one_process", diff, "<=", 1e-5, sentence, ranks=run.info.world_size
                )
            else:
                run.report.value(
                    "ddp_vs_one_process_max", diff, sentence + ORDER_NOTE, ranks=run.info.world_size
                )


def main() -> None:
    args = parse_args()
    if (
        args.spawn
    ):  # mp.spawn instead of torchrun: we do the launcher's work (common/harness/spawn.py)
        spawn_world(train, args.spawn, args)
        return
    with distributed_session(args) as info:
        train(args, info)


if __name__ == "__main__":
    run_main(main)
