"""Lesson 01: the baseline -- train a small CNN on real handwritten digits on ONE device.

Run it:

    python lessons/01_single_gpu.py                       # CUDA if there is a GPU, else CPU
    python lessons/01_single_gpu.py --device cpu --epochs 8
    python lessons/01_single_gpu.py --checkpoint ckpt.pt --epochs 2     # stop after 2 epochs ...
    python lessons/01_single_gpu.py --checkpoint ckpt.pt --resume       # ... and finish the other 2
    python lessons/01_single_gpu.py --check-resume        # both in one run, compared with the last

What to look for:
- The whole algorithm every later lesson distributes (`train_epoch`): sample a batch, forward, loss, backward,
  optimizer step.
- Test accuracy above 0.95 after the default 4 epochs (1438 training images, 359 test images of 8x8 pixels),
  and a test loss that falls from about ln(10) = 2.30 (the untrained model guesses) to under half of it.
- A resumed run ends with exactly the numbers of an uninterrupted one (--check-resume: max difference 0.0 over
  every parameter and buffer): the checkpoint holds the model, the optimizer's momentum buffers and the epoch,
  and the data order depends only on (seed, epoch).
- One process, one device. Starting several processes (torchrun) begins in lesson 02; lesson 03 is the
  small diff that makes them train one model together. Launched as several processes, this lesson says so
  and stops.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from common.data import digits_split
from common.harness.atomic import load_checkpoint, save_checkpoint
from common.harness.env import DistInfo, LessonError, choose_backend_and_device
from common.harness.metrics import evaluate
from common.harness.ranks import peak_rss_mb, print0, rank0_progress
from common.harness.results import Report
from common.harness.session import deterministic_cuda, run_main, set_seed
from common.models import DigitsCNN


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--epochs", type=int, default=4, help="passes over the training set (default %(default)s)"
    )
    p.add_argument(
        "--batch-size", type=int, default=64, help="samples per step (default %(default)s)"
    )
    p.add_argument("--lr", type=float, default=0.02, help="SGD learning rate (default %(default)s)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument(
        "--data", default=None, help="digits .npz (default: the bundled data/digits.npz)"
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: cuda if available, else cpu",
    )
    p.add_argument("--checkpoint", default=None, help="write a checkpoint here after every epoch")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument(
        "--check-resume",
        action="store_true",
        help="also train in two halves joined by a checkpoint and compare with this run",
    )
    p.add_argument("--results", default=None, help="write the reported numbers here as JSON")
    args = p.parse_args(argv)
    if (
        int(os.environ.get("WORLD_SIZE", "1")) > 1
    ):  # a launcher started several copies of this process
        raise LessonError(
            "lesson 01 trains on one device in one process: run it with python (several "
            "processes start in lesson 02)"
        )
    if args.batch_size < 1:
        raise LessonError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.epochs < 0:
        raise LessonError(f"--epochs must be >= 0, got {args.epochs}")
    if args.lr <= 0:
        raise LessonError(f"--lr must be positive, got {args.lr}")
    if args.resume and not args.checkpoint:
        raise LessonError("--resume needs --checkpoint PATH")
    if args.resume and args.check_resume:
        raise LessonError("--check-resume trains from the start; it cannot follow --resume")
    return args


def build(
    args: argparse.Namespace, device: torch.device
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its optimizer. SGD with momentum keeps one buffer per parameter: checkpoint it too."""
    model = DigitsCNN().to(device)  # ~38k parameters; x (B, 1, 8, 8) -> logits (B, 10)
    return model, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    device: torch.device,
    info: DistInfo,
) -> float:
    """One pass over `loader`: the loop every later lesson distributes. Returns the mean train loss."""
    model.train()
    loss_sum, seen = 0.0, 0
    for x, y in rank0_progress(loader, info):
        x, y = x.to(device), y.to(device)  # x (B, 1, 8, 8), y (B,)
        loss = F.cross_entropy(model(x), y)  # mean over the B samples
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum += loss.item() * len(y)  # .item() waits for the GPU: fine at this size
        seen += len(y)
    return loss_sum / seen


def resume_difference(args, loader, generator, device, info, reference: nn.Module) -> float:
    """Train again, stop after epochs // 2, checkpoint, load into a NEW model and optimizer, finish; compare.

    The new model is built from another seed, so only the checkpoint can make the two runs agree.
    Returns max |difference| to `reference` over every parameter and buffer (0.0: the runs are identical).
    """
    half = args.epochs // 2
    set_seed(args.seed)
    model, optimizer = build(args, device)
    for epoch in range(half):
        # the data order of `epoch`, as in the uninterrupted run
        generator.manual_seed(args.seed + epoch)
        train_epoch(model, optimizer, loader, device, info)
    with tempfile.TemporaryDirectory() as tmp:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": half}
        save_checkpoint(state, Path(tmp) / "ckpt.pt", info)
        # "the process restarts": fresh weights, fresh (empty) momentum buffers
        set_seed(args.seed + 1)
        model, optimizer = build(args, device)
        ckpt = load_checkpoint(Path(tmp) / "ckpt.pt", device)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(
        ckpt["optimizer"]
    )  # without it the momentum restarts at 0: runs differ
    for epoch in range(int(ckpt["epoch"]), args.epochs):
        generator.manual_seed(args.seed + epoch)
        train_epoch(model, optimizer, loader, device, info)
    ref = reference.state_dict()
    return max(
        (v.double() - ref[k].double()).abs().max().item() for k, v in model.state_dict().items()
    )


@dataclass
class Run:
    """What main and its checks share: the options, the world of one, the report, the data, the model and
    optimizer, and the epoch to start from (0, or the checkpoint's with --resume)."""

    args: argparse.Namespace
    info: DistInfo
    report: Report
    train_set: TensorDataset  # (1438, 1, 8, 8) images, their labels
    test_set: TensorDataset  # (359, 1, 8, 8)
    loader: DataLoader
    generator: torch.Generator  # the loader's shuffle, seeded per epoch
    model: nn.Module
    optimizer: torch.optim.Optimizer
    start_epoch: int


def setup(args: argparse.Namespace) -> Run:
    """The device, the data, the model and optimizer (from --checkpoint with --resume)."""
    _, device = choose_backend_and_device("auto", args.device)
    if (
        device.type == "cuda"
    ):  # exact resume on a GPU needs deterministic kernels (deterministic_cuda)
        deterministic_cuda()
    # a world of one: evaluate() and save_checkpoint() need no process group
    info = DistInfo(device=device)
    set_seed(args.seed)
    train_set, test_set = digits_split(path=args.data)  # (1438, 1, 8, 8) and (359, 1, 8, 8)
    # shuffle via an explicit generator seeded per epoch: the order depends only on (seed, epoch), so a
    # resumed run sees the same batches as an uninterrupted one.
    generator = torch.Generator()
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, generator=generator)
    model, optimizer = build(args, device)
    start_epoch = 0
    if args.resume:
        # map_location=device: a GPU checkpoint loads on a CPU
        ckpt = load_checkpoint(args.checkpoint, device)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(
            ckpt["optimizer"]
        )  # momentum buffers too, or the next steps differ
        start_epoch = int(ckpt["epoch"])
        print0(f"resumed from {args.checkpoint} at epoch {start_epoch}")
    report = Report(info)
    return Run(
        args, info, report, train_set, test_set, loader, generator, model, optimizer, start_epoch
    )


def main() -> None:
    args = parse_args()
    run = setup(args)
    device = run.info.device
    report = run.report
    report.record("device", device.type)
    report.record("world_size", 1)
    report.value(
        "batch_size",
        args.batch_size,
        "device {device}  batch {value}  epochs {epochs}",
        device=device.type,
        epochs=args.epochs,
    )
    before = test = evaluate(run.model, run.test_set, run.info)  # untrained: about ln(10) = 2.30
    # GPU work is asynchronous: wait for it before reading the clock
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    history, samples_per_s = [], []
    for epoch in range(run.start_epoch, args.epochs):
        # a new order every epoch, the same on every rerun
        run.generator.manual_seed(args.seed + epoch)
        sync()
        t0 = time.perf_counter()
        train_loss = train_epoch(run.model, run.optimizer, run.loader, device, run.info)
        sync()
        samples_per_s.append(len(run.train_set) / (time.perf_counter() - t0))
        test = evaluate(run.model, run.test_set, run.info)
        history.append(
            {
                "epoch": epoch + 1,
                "train_loss": train_loss,
                "test_loss": test["loss"],
                "test_accuracy": test["accuracy"],
            }
        )
        # recorded once, in "history"
        print0(
            f"epoch {epoch + 1}/{args.epochs}  train_loss {train_loss:.4f}  test_loss {test['loss']:.4f}  "
            f"test_acc {test['accuracy']:.4f}"
        )
        if args.checkpoint:  # temporary file + rename: a crash never leaves half a file
            state = {
                "model": run.model.state_dict(),
                "optimizer": run.optimizer.state_dict(),
                "epoch": epoch + 1,
            }
            save_checkpoint(state, args.checkpoint, run.info)
    report.record("history", history)
    report_claims(report, args, test, before, len(run.test_set), samples_per_s)
    if args.check_resume:
        report.claim(
            "resume_reproduces_uninterrupted",
            resume_difference(args, run.loader, run.generator, device, run.info, run.model),
            "==",
            0.0,
            "resumed after epoch {half}: max |difference| to the uninterrupted run "
            "(parameters, buffers) {value:.1e}",
            half=args.epochs // 2,
        )
    report.finish(args.results)


def report_claims(
    report: Report, args, test: dict, before: dict, test_images: int, samples_per_s
) -> None:
    """The run's claims (test: the last epoch's evaluation; before: the untrained model's) and its speed."""
    report.claim(
        "loss_falls",
        test["loss"] / before["loss"],
        "<=",
        0.5,
        "test loss {start:.4f} at this run's start -> {end:.4f}: ratio {value:.3f}",
        start=before["loss"],
        end=test["loss"],
    )
    # the bound is for the default 4 epochs (shorter runs print test_acc per epoch only)
    if args.epochs >= 4:
        report.claim(
            "test_accuracy", test["accuracy"], ">=", 0.95, "final test accuracy {value:.4f}"
        )
    report.claim(
        "each_test_image_counted_once",
        test["count"],
        "==",
        test_images,
        "test images counted: {value}",
    )
    report.perf(
        "samples_per_s",
        samples_per_s,
        "samples/s per epoch: {rates}",
        rates=", ".join(f"{s:.0f}" for s in samples_per_s),
    )
    report.perf("peak_rss_mb", peak_rss_mb(), "peak RSS {value:.0f} MB")


if __name__ == "__main__":
    run_main(main)
