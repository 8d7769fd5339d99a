"""Minimal 09: pipeline parallelism (GPipe) -- the model cut into stages, one per rank.

    torchrun --standalone --nproc_per_node=2 minimal/09_model_parallel.py
    python minimal/09_model_parallel.py                             # plain python: one stage

Each rank holds a slice of the layers (a stage). The batch is cut into m micro-batches; GPipe runs
all m forwards (a stage sends its output to the next with dist.send, the next takes it with
dist.recv), then all m backwards (the gradient of each stage's input travels back the same way).
So stages can work on different micro-batches at once. The check: loss and gradients equal the
unsplit model's. The measured lesson, lessons/09_model_parallel.py, times the idle "bubble", 1F1B.
"""

import argparse
import copy
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def load_digits():
    """The lessons' training set: 80% of each class, fixed by seed 0 (1438 images)."""
    with np.load(Path(__file__).resolve().parent.parent / "data" / "digits.npz") as f:
        x = torch.from_numpy(f["images"].astype(np.float32) / 16.0).unsqueeze(1)  # (1797, 1, 8, 8)
        y = torch.from_numpy(f["labels"].astype(np.int64))  # (1797,) digits 0..9
    g, is_test = torch.Generator().manual_seed(0), torch.zeros(len(y), dtype=torch.bool)
    for c in range(10):
        idx = torch.nonzero(y == c).flatten()
        is_test[idx[torch.randperm(len(idx), generator=g)][: round(0.2 * len(idx))]] = True
    return x[~is_test], y[~is_test]


def make_model() -> nn.Sequential:
    """Lesson 09's mlp: 8 Linear layers 64 -> 64 ... -> 10 with ReLU between (15 modules)."""
    layers = [m for _ in range(7) for m in (nn.Linear(64, 64), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(64, 10))


def train(args, rank, world_size, device) -> None:
    # --- data and model: every rank builds the whole model from one seed, keeps its stage ---
    x_all, y_all = load_digits()
    pick = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(args.seed + 1))[:32]
    x, y = x_all[pick].flatten(1).to(device), y_all[pick].to(device)  # (32, 64), (32,)
    torch.manual_seed(args.seed)
    model = make_model().to(device)
    reference = copy.deepcopy(model)  # the unsplit model, for the check
    cut = [2 * round(k * 8 / world_size) for k in range(world_size + 1)]  # 4 Linears per stage at 2
    stage = model[cut[rank] : cut[rank + 1]]  # this rank's layers
    first, last = rank == 0, rank == world_size - 1

    # --- GPipe: all m forwards, then all m backwards ---
    held, loss = [], torch.zeros((), device=device)  # loss: on the last stage
    for xm, ym in zip(x.chunk(args.microbatches), y.chunk(args.microbatches)):
        h = xm  # (b, 64) on the first stage
        if not first:
            h = torch.empty(len(xm), 64, device=device)
            dist.recv(h, src=rank - 1)  # the previous stage's output
            h.requires_grad_()  # we need d loss / d h, to send it back
        out = stage(h)
        if last:  # a micro-batch's mean loss, weighted n_i / N: the sum is the batch's mean loss
            out = F.cross_entropy(out, ym) * len(ym) / len(y)
            loss += out.detach()
        else:
            dist.send(out.detach(), dst=rank + 1)
        held.append((h, out))  # kept for backward: GPipe holds all m micro-batches' activations
    for h, out in reversed(held):
        if last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=rank + 1)  # d loss / d out, from the next stage
            out.backward(grad)
        if not first:
            dist.send(h.grad, dst=rank - 1)

    # --- the check: loss and this stage's gradients equal the unsplit model's ---
    ref_loss = F.cross_entropy(reference(x), y)  # the whole batch at once
    ref_loss.backward()
    dist.broadcast(loss, src=world_size - 1)  # the last stage computed it
    pairs = zip(stage.parameters(), reference[cut[rank] : cut[rank + 1]].parameters())
    diffs = [(loss - ref_loss).abs(), *((a.grad - b.grad).abs().max() for a, b in pairs)]
    diff = torch.stack(diffs).max()
    worst = diff.clone()  # for the printout; each rank checks its own diff (gloo's MAX drops NaN)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:  # one JSON line, full precision: a test compares the loss with lesson 09's
        out = {"stages": world_size, "microbatches": args.microbatches}
        out.update(loss=loss.item(), max_diff=worst.item())
        print(json.dumps(out))
    torch.testing.assert_close(diff, torch.zeros_like(diff), rtol=0, atol=1e-5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--microbatches", type=int, default=4, help="m; the batch is 32")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    # --- setup: one process per device, started by torchrun (which sets RANK, WORLD_SIZE, ...) ---
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # the device on this node; RANK is global
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: NCCL binds this process to its GPU
    if "RANK" not in os.environ:  # plain python: what torchrun would set, for a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT="0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # reads those variables
    try:
        train(args, rank, world_size, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
