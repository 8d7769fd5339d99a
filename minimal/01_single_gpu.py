"""Minimal 01: train a small CNN on the handwritten digits on ONE device -- the loop to distribute.

    python minimal/01_single_gpu.py --epochs 2     # cuda if there is a GPU, else cpu
    python minimal/01_single_gpu.py

Each later script is a small diff from this one: `diff minimal/01_single_gpu.py minimal/03_ddp.py`.
The measured lesson is lessons/01_single_gpu.py; a test holds this script to its numbers.
"""

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def load_digits():
    """(train, test) as the lessons split them: 20% of each class held out, fixed by seed 0."""
    with np.load(Path(__file__).resolve().parent.parent / "data" / "digits.npz") as f:
        x = torch.from_numpy(f["images"].astype(np.float32) / 16.0).unsqueeze(1)  # (1797, 1, 8, 8)
        y = torch.from_numpy(f["labels"].astype(np.int64))  # (1797,) digits 0..9
    g, is_test = torch.Generator().manual_seed(0), torch.zeros(len(y), dtype=torch.bool)
    for c in range(10):
        idx = torch.nonzero(y == c).flatten()
        is_test[idx[torch.randperm(len(idx), generator=g)][: round(0.2 * len(idx))]] = True
    return TensorDataset(x[~is_test], y[~is_test]), TensorDataset(x[is_test], y[is_test])


def make_model() -> nn.Module:
    """The lessons' DigitsCNN: the same layers in the same order give the same initial weights."""
    return nn.Sequential(  # x (B, 1, 8, 8) -> logits (B, 10), ~38k parameters
        nn.Conv2d(1, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def train(args, device) -> None:
    # --- data and model ---
    torch.manual_seed(args.seed)  # the initial weights
    train_set, test_set = load_digits()  # (1438, 1, 8, 8) and (359, 1, 8, 8)
    generator = torch.Generator()  # seeded per epoch: the order depends only on (seed, epoch)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, generator=generator)
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

    # --- the training loop ---
    for epoch in range(args.epochs):
        generator.manual_seed(args.seed + epoch)  # a new order every epoch
        loss_sum, seen = 0.0, 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)  # x (B, 1, 8, 8), y (B,)
            loss = F.cross_entropy(model(x), y)  # mean over the B samples
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum, seen = loss_sum + loss.item() * len(y), seen + len(y)
        sums = torch.tensor([loss_sum, seen], dtype=torch.float64, device=device)  # float64: exact
        # one JSON line per epoch, full precision: a test compares it with the lesson
        print(json.dumps({"epoch": epoch + 1, "train_loss": (sums[0] / sums[1]).item()}))

    # --- the check: the model learned (an untrained model scores about ln(10) = 2.30) ---
    model.eval()  # BatchNorm uses its running statistics
    x_test, y_test = (t.to(device) for t in test_set.tensors)  # (359, 1, 8, 8), (359,)
    with torch.no_grad():
        test_loss = F.cross_entropy(model(x_test), y_test).item()
    print(f"test loss {test_loss:.4f}")
    assert test_loss < 0.5 * math.log(10), "the test loss did not halve"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    # --- setup: one process, one device ---
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train(args, device)


if __name__ == "__main__":
    main()
