"""Evaluation on every rank without counting padded samples twice (lesson 03); lesson 05's sums over an
unpadded shard, and the one-process evaluation it is held to.

`DistributedSampler` with `drop_last=False` pads the index list by repeating its start until it divides by
world_size: 10 samples over 3 ranks become 12 positions, positions 10 and 11 repeating samples 0 and 1. Rank r
reads positions r, r + W, r + 2W, ...; a position >= len(dataset) is padding and must not be counted.
(https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler)
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from common.harness.env import DistInfo, LessonError
from common.harness.ranks import all_reduce_sum

__all__ = ["is_padding", "evaluate", "shard_sums", "one_process_eval"]


def is_padding(dataset_len: int, world_size: int, rank: int) -> torch.Tensor:
    """Which of this rank's `DistributedSampler(drop_last=False)` indices are padding repeats.

    Returns:
        bool tensor (ceil(dataset_len / world_size),): True where the position r + k*world_size >= dataset_len.
        The same holds with shuffle on or off: padding is always appended after the (shuffled) list.
    """
    per_rank = math.ceil(dataset_len / world_size)
    positions = rank + world_size * torch.arange(per_rank)
    return positions >= dataset_len


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, info: DistInfo, batch_size: int = 256) -> dict:
    """Loss and accuracy of `model` on `dataset`, computed in shards by all ranks and reduced exactly.

    Each rank evaluates its `DistributedSampler` shard, drops the padding, and sums (loss, correct, count);
    `all_reduce_sum` adds those sums over ranks and every rank divides once. For a model that is the same on every
    rank (parameters AND buffers: after DDP training, BatchNorm's running statistics differ by each rank's last
    batch) the answer equals a single-process evaluation of the whole dataset for any world size.

    Pass the unwrapped model (`raw_model`), not the DDP wrapper. Here every rank gets the same number of
    batches (the sampler pads), but with an unpadded sampler a rank can have fewer batches or none, and a DDP
    forward may broadcast buffers, a collective that such a rank never joins: the others wait until the
    timeout (lesson 05 shows it). Evaluation needs no gradient sync, so the wrapper adds nothing here.

    Returns:
        {"loss": mean cross-entropy, "accuracy": fraction correct, "count": samples counted (= len(dataset))}

    Raises:
        LessonError: the dataset is empty (every rank sees the same length, so every rank raises alike).
    """
    if len(dataset) == 0:
        raise LessonError("evaluate: the dataset is empty; there is nothing to average over")
    was_training = model.training
    model.eval()
    sampler = DistributedSampler(
        dataset, num_replicas=info.world_size, rank=info.rank, shuffle=False
    )
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    padding = is_padding(len(dataset), info.world_size, info.rank)
    loss_sum = correct = count = 0.0
    seen = 0
    for x, y in loader:
        x, y = x.to(info.device), y.to(info.device)
        logits = model(x)
        real = ~padding[seen : seen + len(y)].to(info.device)  # (B,) False on padded repeats
        seen += len(y)
        loss_sum += F.cross_entropy(logits, y, reduction="none")[real].sum().item()
        correct += (logits.argmax(dim=1) == y)[real].sum().item()
        count += real.sum().item()
    model.train(was_training)
    loss_sum, correct, count = all_reduce_sum([loss_sum, correct, count], info)
    return {"loss": loss_sum / count, "accuracy": correct / count, "count": int(count)}


@torch.no_grad()
def shard_sums(model: nn.Module, dataset: Dataset, sampler: Sampler, device) -> list[float]:
    """(loss_sum, correct, count) of `model` over the samples `sampler` gives this rank (lesson 05): sums, so
    that `all_reduce_sum` adds them over ranks, an empty shard's [0, 0, 0] included, and one division follows."""
    sums = [0.0, 0.0, 0.0]
    for x, y in DataLoader(dataset, batch_size=128, sampler=sampler):
        logits, y = model(x.to(device)), y.to(device)  # logits (B, 10)
        sums[0] += F.cross_entropy(logits, y, reduction="sum").item()
        sums[1] += (logits.argmax(1) == y).sum().item()
        sums[2] += len(y)
    return sums


@torch.no_grad()
def one_process_eval(model: nn.Module, dataset: TensorDataset, device) -> tuple[dict, torch.Tensor]:
    """The reference a sharded evaluation must equal: `model` on the whole of `dataset` in one forward, in this
    process alone. Returns ({"loss", "accuracy"}, logits (N, classes) on the CPU)."""
    xs, ys = dataset.tensors
    logits = model(xs.to(device)).cpu()
    single = {
        "loss": F.cross_entropy(logits, ys).item(),
        "accuracy": (logits.argmax(1) == ys).double().mean(),
    }
    return single, logits
