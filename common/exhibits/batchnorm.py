"""Lesson 12's BatchNorm exhibits: a batch of one in training mode, SyncBatchNorm without a GPU."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from common.exhibits.frame import Ctx, exhibit

__all__ = ["batchnorm_batch_of_one", "syncbatchnorm_on_cpu"]


@exhibit(
    "batchnorm_batch_of_one",
    "training",
    lesson="06",
    symptom="ValueError: Expected more than 1 value per channel "
    "when training, got input size torch.Size([1, 4])",
    cause="the last batch of a rank holds one sample (ceil(len(dataset) "
    "/ world_size) % batch_size == 1: the sampler pads)",
    fix="DataLoader(drop_last=True) for training",
)
def batchnorm_batch_of_one(ctx: Ctx) -> None:
    bn = nn.BatchNorm1d(4).train()
    n, batch, world = (
        17,
        4,
        2,
    )  # 17 samples, 4 per rank, 2 ranks: the last step leaves 1 sample on a rank
    shard = list(
        DistributedSampler(range(n), num_replicas=world, rank=0, shuffle=False)
    )  # padded to 18: 9
    last = min(len(b) for b in DataLoader(shard, batch_size=batch))  # batches of 4, 4, 1
    o = ctx.attempt(bn, torch.randn(last, 4))
    ctx.step(
        "symptom",
        f"{n} samples, {world} ranks, {batch} per batch: the last batch holds {last} sample",
    )
    ctx.say(f"    {o.error}")
    ctx.record("symptom", o.error)
    ctx.claim(
        "broken_raises",
        int("Expected more than 1 value per channel" in (o.error or "")),
        "==",
        1,
        "BatchNorm raises on a batch of one: {value}",
    )
    ctx.step(
        "diagnosis",
        "print ceil(len(dataset) / world_size) % batch_size and each rank's last batch size",
    )
    ctx.step(
        "fix", "DataLoader(drop_last=True) for training (or a SyncBatchNorm over the global batch)"
    )
    smallest = min(len(b) for b in DataLoader(shard, batch_size=batch, drop_last=True))
    ctx.claim(
        "fixed_smallest_batch",
        smallest,
        "==",
        batch,
        "with drop_last the smallest batch holds {value}",
    )


@exhibit(
    "syncbatchnorm_on_cpu",
    "training",
    min_world=2,
    lesson="06",
    symptom=(
        "ValueError: SyncBatchNorm expected input tensor to be on GPU or XPU or privateuseone"
    ),
    cause="torch.nn.SyncBatchNorm runs on CUDA (and a few accelerators) only",
    when=("on CPU; wrapped by DDP: `ValueError: SyncBatchNorm layers only work with GPU modules`"),
    fix=("common.data_parallel.sync_batchnorm.SyncBatchNorm (lesson 06, all-reduces, any device)"),
)
def syncbatchnorm_on_cpu(ctx: Ctx) -> None:
    from common.data_parallel.sync_batchnorm import SyncBatchNorm

    g = ctx.group()
    o = ctx.attempt(nn.SyncBatchNorm(4, process_group=g), torch.randn(3, 4))
    o2 = ctx.attempt(DDP, nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4)), process_group=g)
    ctx.step("symptom", "nn.SyncBatchNorm on CPU, alone and wrapped by DDP:")
    for err in (o.error, o2.error):
        ctx.say(f"    {err}")
    ctx.record("symptom", [o.error, o2.error])
    ctx.claim(
        "broken_raises",
        int(
            "expected input tensor to be on GPU" in (o.error or "")
            and "only work with GPU modules" in (o2.error or "")
        ),
        "==",
        1,
        "both raise on CPU: {value}",
    )
    ctx.step(
        "diagnosis",
        "the layer checks input.is_cuda (and DDP the module's device) before communicating",
    )
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(ctx.info.rank))
    y = SyncBatchNorm(4, process_group=ctx.group())(x)
    n = torch.tensor([float(y.shape[0])])
    s = y.detach().sum(0)
    dist.all_reduce(s)
    dist.all_reduce(n)
    ctx.step(
        "fix",
        "common.data_parallel.sync_batchnorm.SyncBatchNorm (lesson 06, all-reduces, any device) on CPU",
    )
    ctx.claim(
        "fixed_global_mean",
        (s / n).abs().max().item(),
        "<=",
        1e-6,
        "|mean over the global batch| of the normalised output: {value:.1e}",
    )
