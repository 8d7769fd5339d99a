"""Lesson 01: the baseline -- train a small CNN on real handwritten digits on ONE device.

Run it:

    python lessons/01_single_gpu.py                       # CUDA if there is a GPU, else CPU
    python lessons/01_single_gpu.py --device cpu --epochs 8
    python lessons/01_single_gpu.py --checkpoint ckpt.pt --epochs 2     # stop after 2 epochs ...
    python lessons/01_single_gpu.py --checkpoint ckpt.pt --resume       # ... and finish the other 2

What to look for:
- The whole algorithm every later lesson distributes: sample a batch, forward, loss, backward, optimizer step.
- Test accuracy above 0.95 after the default 4 epochs (1438 training images, 359 test images of 8x8 pixels).
- A resumed run ends with exactly the numbers of an uninterrupted one: the checkpoint holds the model, the
  optimizer's momentum buffers and the epoch, and the data order depends only on (seed, epoch).
- Under `torchrun --nproc_per_node=2` this script still runs, but each process trains its OWN copy on the
  whole dataset: two processes, no cooperation. Lesson 03 is the small diff that makes them cooperate.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common.checkpoint import load_checkpoint, save_checkpoint, write_results
from common.data import digits_split
from common.ranks import peak_rss_mb, print0, rank0_progress
from common.session import DistInfo, LessonError, choose_backend_and_device, read_torchrun_env, run_main, set_seed
from common.metrics import evaluate
from common.models import DigitsCNN


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=4, help="passes over the training set (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per step (default %(default)s)")
    p.add_argument("--lr", type=float, default=0.02, help="SGD learning rate (default %(default)s)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--data", default=None, help="digits .npz (default: the bundled data/digits.npz)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda if available, else cpu")
    p.add_argument("--checkpoint", default=None, help="write a checkpoint here after every epoch")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--results", default=None, help="write the reported numbers here as JSON")
    args = p.parse_args(argv)
    if args.batch_size < 1:
        raise LessonError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.epochs < 0:
        raise LessonError(f"--epochs must be >= 0, got {args.epochs}")
    if args.lr <= 0:
        raise LessonError(f"--lr must be positive, got {args.lr}")
    if args.resume and not args.checkpoint:
        raise LessonError("--resume needs --checkpoint PATH")
    return args


def main() -> None:
    args = parse_args()
    # No process group here. Under torchrun, LOCAL_RANK still picks this process's GPU and RANK 0 alone prints
    # and writes files -- but every process trains alone on everything.
    rank, local_rank, world_size, local_world_size = read_torchrun_env()
    _, device = choose_backend_and_device("auto", args.device, local_rank, local_world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # cuda:LOCAL_RANK: synchronize() and new tensors then use this rank's GPU
    master_process = rank == 0  # prints and writes files
    info = DistInfo(device=device)  # a world of one: evaluate() and save_checkpoint() need no process group

    set_seed(args.seed)
    train_set, test_set = digits_split(path=args.data)  # (1438, 1, 8, 8) and (359, 1, 8, 8)
    # shuffle via an explicit generator seeded per epoch: the order depends only on (seed, epoch), so a
    # resumed run sees the same batches as an uninterrupted one.
    generator = torch.Generator()
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, generator=generator)

    model = DigitsCNN().to(device)  # ~38k parameters; x (B, 1, 8, 8) -> logits (B, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    start_epoch = 0
    if args.resume:
        ckpt = load_checkpoint(args.checkpoint, device)  # map_location=device: a GPU checkpoint loads on a CPU
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])  # momentum buffers too, or the next steps differ
        start_epoch = int(ckpt["epoch"])
        print0(f"resumed from {args.checkpoint} at epoch {start_epoch}")

    print0(f"device {device.type}  batch {args.batch_size}  epochs {args.epochs}"
           + (f"  (one of {world_size} independent processes)" if world_size > 1 else ""))
    history, samples_per_s = [], []
    for epoch in range(start_epoch, args.epochs):
        generator.manual_seed(args.seed + epoch)  # a new order every epoch, the same order on every rerun
        model.train()
        loss_sum, seen = 0.0, 0
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x, y in rank0_progress(loader, info, desc=f"epoch {epoch + 1}"):
            x, y = x.to(device), y.to(device)  # x (B, 1, 8, 8), y (B,)
            loss = F.cross_entropy(model(x), y)  # mean over the B samples
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(y)  # .item() waits for the GPU: fine at this size
            seen += len(y)
        if device.type == "cuda":
            torch.cuda.synchronize()  # GPU work is asynchronous: wait before reading the clock
        elapsed = time.perf_counter() - t0
        test = evaluate(model, test_set, info)
        history.append({"epoch": epoch + 1, "train_loss": loss_sum / seen, "test_loss": test["loss"],
                        "test_accuracy": test["accuracy"]})
        samples_per_s.append(seen / elapsed)
        print0(f"epoch {epoch + 1}/{args.epochs}  train_loss {loss_sum / seen:.4f}  test_loss {test['loss']:.4f}  "
               f"test_acc {test['accuracy']:.4f}")
        print0(f"[perf] epoch {epoch + 1}: {elapsed:.2f} s, {seen / elapsed:.0f} samples/s")
        if args.checkpoint and master_process:  # temporary file + rename: a crash never leaves half a file
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}
            save_checkpoint(state, args.checkpoint, info)

    final = evaluate(model, test_set, info)
    print0(f"final test_loss {final['loss']:.4f}  test_acc {final['accuracy']:.4f}  on {final['count']} images")
    print0(f"[perf] peak RSS {peak_rss_mb():.0f} MB")
    if master_process:
        write_results(args.results, {"device": device.type, "batch_size": args.batch_size, "history": history,
                                     "final_test_loss": final["loss"], "final_test_accuracy": final["accuracy"],
                                     "test_count": final["count"], "samples_per_s": samples_per_s,
                                     "world_size": world_size}, info)


if __name__ == "__main__":
    run_main(main)
