"""Datasets for the lessons (introduced in lesson 01).

- The bundled real data: UCI handwritten digits, 1797 images of 8x8 pixels, 10 classes (see data/README.md),
  with a fixed stratified train/test split.
- Synthetic image classification data of any size, for scaling experiments where the digits are too small.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Subset, TensorDataset

from common.harness.env import LessonError

__all__ = [
    "DIGITS_PATH",
    "NUM_CLASSES",
    "DIGITS_SHA256",
    "load_digits",
    "digits_split",
    "digit_rows",
    "synthetic_images",
    "synthetic_split",
    "imbalanced_subset",
    "class_hist",
    "digit_sequences",
    "next_token_targets",
    "global_batch_slices",
    "PIXEL_VOCAB",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
DIGITS_PATH = REPO_ROOT / "data" / "digits.npz"
DIGITS_SHA256 = "78e5a74b029974419349896fa823a199cbb032ab175f49da25f1f4ca672be40c"
NUM_CLASSES = 10
PIXEL_VOCAB = 17  # a digit pixel is an integer count 0..16


def load_digits(path: str | Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Load the digits as tensors.

    Args:
        path: an .npz with `images` (N, 8, 8) and `labels` (N,); default: the bundled data/digits.npz, whose
            SHA-256 is checked.

    Returns:
        images: float32 (N, 1, 8, 8), pixel counts 0..16 scaled to [0, 1]; labels: int64 (N,), values 0..9.

    Raises:
        LessonError: the file is missing, unreadable, or (for the bundled file) not the bytes we shipped.
    """
    path = DIGITS_PATH if path is None else Path(path)
    if not path.is_file():
        raise LessonError(
            f"data file not found: {path} (the repository bundles data/digits.npz; "
            "see data/README.md)"
        )
    raw = path.read_bytes()
    if path.resolve() == DIGITS_PATH and hashlib.sha256(raw).hexdigest() != DIGITS_SHA256:
        raise LessonError(
            f"{path} does not match its SHA-256 in data/README.md; restore it with git checkout"
        )
    try:
        with np.load(path) as f:
            images, labels = f["images"], f["labels"]
    except Exception as e:  # a corrupt or foreign file: say which, in one line
        raise LessonError(f"cannot read {path} as digits data ({type(e).__name__}: {e})") from None
    if images.ndim != 3 or labels.shape != (images.shape[0],):
        raise LessonError(
            f"{path}: expected images (N, H, W) and labels (N,), got {images.shape} and {labels.shape}"
        )
    x = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)  # (N, 1, 8, 8) in [0, 1]
    y = torch.from_numpy(labels.astype(np.int64))
    return x, y


def digits_split(
    test_fraction: float = 0.2, seed: int = 0, path: str | Path | None = None
) -> tuple[TensorDataset, TensorDataset]:
    """The digits split into (train, test), stratified by class and identical on every call and every rank.

    With the defaults: 1438 training and 359 test images, each class in the same proportion in both.
    Every rank calls this and gets the same split, so no rank needs to broadcast data.

    Raises:
        LessonError: test_fraction outside (0, 1), or see `load_digits`.
    """
    if not 0.0 < test_fraction < 1.0:
        raise LessonError(f"test_fraction must be in (0, 1), got {test_fraction}")
    x, y = load_digits(path)
    g = torch.Generator().manual_seed(seed)
    test_idx = []
    for c in range(int(y.max()) + 1):
        idx = torch.nonzero(y == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        test_idx.append(idx[: round(test_fraction * len(idx))])
    is_test = torch.zeros(len(y), dtype=torch.bool)
    is_test[torch.cat(test_idx)] = True
    return TensorDataset(x[~is_test], y[~is_test]), TensorDataset(x[is_test], y[is_test])


def digit_rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n training digits picked by a seeded permutation, the same on every rank: x (n, 64) flattened 8x8
    images, y (n,)."""
    images, labels = digits_split()[0].tensors  # (1438, 1, 8, 8), (1438,)
    pick = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed + 1))[:n]
    return images[pick].flatten(1), labels[pick]  # (n, 64), (n,)


def synthetic_images(
    num_samples: int,
    image_size: int = 8,
    channels: int = 1,
    num_classes: int = NUM_CLASSES,
    noise: float = 0.5,
    seed: int = 0,
) -> TensorDataset:
    """A learnable synthetic classification set: one random template per class plus Gaussian noise.

    Returns:
        TensorDataset of x float32 (num_samples, channels, image_size, image_size) and y int64 (num_samples,).

    Raises:
        LessonError: a size or count below 1, or negative noise.
    """
    if min(num_samples, image_size, channels, num_classes) < 1 or noise < 0:
        raise LessonError("synthetic_images needs positive sizes and counts and noise >= 0")
    g = torch.Generator().manual_seed(seed)
    templates = torch.rand(num_classes, channels, image_size, image_size, generator=g)
    y = torch.randint(num_classes, (num_samples,), generator=g)
    x = templates[y] + noise * torch.randn(
        num_samples, channels, image_size, image_size, generator=g
    )
    return TensorDataset(x, y)


def synthetic_split(
    num_samples: int, image_size: int = 32, test_fraction: float = 0.2, seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """`synthetic_images` cut into (train, test) that share the class templates (the test set is learnable).

    Returns:
        train and test TensorDatasets of x (n, 1, image_size, image_size), y (n,); test has
        round(test_fraction * num_samples) samples, at least 1.

    Raises:
        LessonError: test_fraction outside (0, 1) or num_samples < 2, or see `synthetic_images`.
    """
    if not 0.0 < test_fraction < 1.0 or num_samples < 2:
        raise LessonError(
            f"synthetic_split needs num_samples >= 2 and test_fraction in (0, 1), "
            f"got {num_samples} and {test_fraction}"
        )
    x, y = synthetic_images(num_samples, image_size=image_size, seed=seed).tensors
    n_test = max(1, round(test_fraction * num_samples))
    return TensorDataset(x[n_test:], y[n_test:]), TensorDataset(x[:n_test], y[:n_test])


def imbalanced_subset(
    train_set: TensorDataset, imbalance: float, seed: int
) -> tuple[Subset, torch.Tensor]:
    """Keep fraction imbalance**(c/9) of class c (all of class 0, `imbalance` of class 9), at least 2 each.
    Returns (Subset, labels (m,) int64). The choice is seeded, hence identical on every rank (lesson 04)."""
    y = train_set.tensors[1]
    g = torch.Generator().manual_seed(seed)
    keep = []
    for c in range(NUM_CLASSES):
        idx = torch.nonzero(y == c).flatten()
        k = max(2, round(len(idx) * imbalance ** (c / (NUM_CLASSES - 1))))
        keep.append(idx[torch.randperm(len(idx), generator=g)[:k]])
    keep = torch.sort(torch.cat(keep)).values
    return Subset(train_set, keep.tolist()), y[keep]


def class_hist(labels: torch.Tensor, indices: list[int]) -> list[int]:
    """How many of `indices` fall in each class: (NUM_CLASSES,) counts (lesson 04's histograms per rank)."""
    drawn = labels[torch.as_tensor(indices, dtype=torch.int64)]
    return torch.bincount(drawn, minlength=NUM_CLASSES).tolist()


def digit_sequences(test_fraction: float = 0.2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The digits as token sequences for a causal language model (lessons 19-21): each 8x8 image read row by
    row as 64 pixel tokens, integers 0..16 (`PIXEL_VOCAB` = 17), split as `digits_split` splits the images.

    Returns:
        train (1438, 64) and test (359, 64) int64 tensors, the same on every call and every rank.
    """
    train, test = digits_split(test_fraction, seed)
    return tuple((ds.tensors[0] * 16).round().long().flatten(1) for ds in (train, test))


def next_token_targets(tokens: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Targets for next-token prediction, aligned with the inputs: target[:, t] = tokens[:, t + 1]; the last
    position has no next token and gets `ignore_index` (so a sequence of S tokens has S - 1 targets).

    Shapes: tokens (B, S) -> targets (B, S).
    """
    last = torch.full_like(tokens[:, :1], ignore_index)
    return torch.cat([tokens[:, 1:], last], dim=1)


def global_batch_slices(
    dataset: TensorDataset,
    steps: int,
    global_batch: int,
    seed: int,
    rank: int,
    world_size: int,
    first: int = 0,
    device: torch.device | str = "cpu",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Steps first .. first+steps-1 of one fixed stream of global batches, and this rank's 1/N slice of each.

    Step t's global batch is perm[t B : (t + 1) B] (wrapping around the data), perm fixed by `seed`; rank r takes
    its r-th B/N of it. The stream does not depend on the world size, so a run on 4 ranks and one on 2 ranks see
    the same global batches: what lets a checkpoint continue on another world size (lessons 13 and 15).
    """
    if global_batch % world_size:
        raise LessonError(
            f"a global batch of {global_batch} cannot be split over {world_size} ranks"
        )
    x_all, y_all = dataset.tensors
    perm = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(seed))
    b = global_batch // world_size  # per-rank micro-batch
    batches = []
    for step in range(first, first + steps):
        i = perm[(step * global_batch + rank * b + torch.arange(b)) % len(perm)]
        batches.append((x_all[i].to(device), y_all[i].to(device)))  # (b, 1, 8, 8), (b,)
    return batches
