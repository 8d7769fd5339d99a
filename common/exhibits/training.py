"""Lesson 12's exhibits of training-loop mistakes: wrong numbers and errors that need no hang to show.

Most run on any number of ranks (one process included); those that use DDP build it on a fresh gloo group
(`Ctx.group`). See `common.exhibits.frame` for the frame.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from common.exhibits.frame import Ctx, exhibit

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


@exhibit(
    "set_epoch_forgotten",
    "training",
    lesson="03",
    symptom="",
    cause="DistributedSampler shuffles with seed + epoch; "
    "without sampler.set_epoch(epoch) epoch stays 0",
    when=("no error: every epoch visits the samples in the same order (the loss curve repeats)"),
    fix="sampler.set_epoch(epoch) before each epoch",
)
def set_epoch_forgotten(ctx: Ctx) -> None:
    def orders(call_set_epoch: bool) -> list[list[int]]:
        s = DistributedSampler(
            range(16), num_replicas=2, rank=ctx.info.rank % 2, shuffle=True, seed=0
        )
        out = []
        for epoch in range(3):
            if call_set_epoch:
                s.set_epoch(epoch)
            out.append(list(s)[:4])  # this rank's first 4 indices of the epoch
        return out

    broken, fixed = orders(False), orders(True)
    ctx.step("symptom", f"first indices of epochs 0, 1, 2 without set_epoch: {broken}")
    ctx.claim(
        "broken_distinct_orders",
        len({tuple(o) for o in broken}),
        "==",
        1,
        "distinct orders over 3 epochs without set_epoch: {value}",
    )
    ctx.step("diagnosis", "print the first indices of each epoch on one rank: they repeat")
    ctx.step("fix", f"sampler.set_epoch(epoch) before each epoch: {fixed}")
    ctx.claim(
        "fixed_distinct_orders",
        len({tuple(o) for o in fixed}),
        "==",
        3,
        "distinct orders over 3 epochs with set_epoch: {value}",
    )


@exhibit(
    "checkpoint_module_prefix",
    "training",
    lesson="03",
    symptom="RuntimeError: Error(s) in loading state_dict for Linear: Missing key(s) in state_dict: "
    '"weight", "bias". Unexpected key(s) in state_dict: "module.weight", "module.bias".',
    cause="the checkpoint was saved from the DDP wrapper "
    "(ddp_model.state_dict()), whose keys start with module.",
    fix=(
        "strip the prefix: "
        "torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, 'module.')"
    ),
)
def checkpoint_module_prefix(ctx: Ctx) -> None:
    torch.manual_seed(0)
    raw_model = nn.Linear(4, 2)
    if ctx.info.distributed:
        saved = DDP(
            raw_model, process_group=ctx.group()
        ).state_dict()  # torch.save(ddp_model.state_dict())
    else:  # one process: the keys the DDP wrapper would have saved
        saved = {f"module.{k}": v for k, v in raw_model.state_dict().items()}
    o = ctx.attempt(nn.Linear(4, 2).load_state_dict, saved)
    ctx.step("symptom", "load a checkpoint saved from the DDP wrapper into the plain model:")
    ctx.say("    " + o.full.replace("\n", " ").replace("\t", "").strip())
    ctx.record("symptom", o.error)
    ctx.claim(
        "broken_raises",
        int('Unexpected key(s) in state_dict: "module.weight"' in o.full),
        "==",
        1,
        "load_state_dict rejects the module.-prefixed keys: {value}",
    )
    ctx.step("diagnosis", f"the saved keys: {sorted(saved)}")
    buf = io.BytesIO()
    torch.save(saved, buf)  # the checkpoint as written, read back as a user would
    checkpoint = torch.load(io.BytesIO(buf.getvalue()))
    consume_prefix_in_state_dict_if_present(checkpoint, "module.")
    torch.manual_seed(1)
    fixed = nn.Linear(4, 2)  # a fresh model: different weights until it loads
    before = max(
        (p - q).abs().max().item() for p, q in zip(fixed.parameters(), raw_model.parameters())
    )
    fixed.load_state_dict(checkpoint)
    ctx.step(
        "fix",
        "strip the prefix: torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, "
        f"'module.'), then load (a fresh model differed by {before:.2f} before); next time save "
        "ddp_model.module.state_dict()",
    )
    diff = torch.stack(
        [(p - q).abs().max() for p, q in zip(fixed.parameters(), raw_model.parameters())]
    )
    ctx.claim(
        "fixed_equal",
        diff.max().item(),
        "==",
        0.0,
        "max |difference| of the loaded weight and bias from the saved model's: {value}",
    )


@exhibit(
    "checkpoint_weights_only",
    "training",
    lesson="01",
    symptom="_pickle.UnpicklingError: Weights only load failed ... Unsupported "
    "global: GLOBAL argparse.Namespace was not an allowed global by default",
    cause="torch.load defaults to weights_only=True since "
    "2.6; the checkpoint pickled an arbitrary object",
    fix="save plain types (vars(args), a dict) and keep weights_only=True",
)
def checkpoint_weights_only(ctx: Ctx) -> None:
    buf = io.BytesIO()
    torch.save({"model": nn.Linear(4, 2).state_dict(), "args": argparse.Namespace(lr=0.1)}, buf)
    o = ctx.attempt(torch.load, io.BytesIO(buf.getvalue()))
    unsupported = next(
        (line.strip() for line in o.full.splitlines() if "Unsupported global" in line), ""
    )
    ctx.step(
        "symptom",
        f"torch.load of a checkpoint that holds argparse.Namespace: {o.error.split('.')[0]}.",
    )
    ctx.say(f"    {unsupported}")
    ctx.record("symptom", unsupported)
    ctx.claim(
        "broken_raises",
        int("argparse.Namespace" in unsupported),
        "==",
        1,
        "torch.load names the unsupported global argparse.Namespace: {value}",
    )
    ctx.step(
        "diagnosis",
        "the message names the class; only load weights_only=False from a source you trust",
    )
    buf = io.BytesIO()
    torch.save(
        {"model": nn.Linear(4, 2).state_dict(), "args": vars(argparse.Namespace(lr=0.1))}, buf
    )
    loaded = torch.load(io.BytesIO(buf.getvalue()))  # weights_only=True, the default
    ctx.step(
        "fix",
        "save plain types (vars(args), a dict) and keep weights_only=True; or "
        "torch.serialization.add_safe_globals([argparse.Namespace])",
    )
    ctx.claim(
        "fixed_loads", loaded["args"]["lr"], "==", 0.1, "the dict checkpoint loads: lr {value}"
    )


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


def _thread_counts(out: str) -> list[tuple[int, int]]:
    """[(torch threads, DataLoader worker threads), ...] from the `threads` worker's lines."""
    found = re.findall(r"torch threads (\d+), DataLoader worker threads (\d+)", out)
    return [(int(t), int(w)) for t, w in found]


@exhibit(
    "too_many_threads",
    "training",
    lesson="03",
    symptom="",
    cause="each process starts the torch threads it would start alone (one "
    "per core); torchrun sets OMP_NUM_THREADS=1 when nproc_per_node "
    "> 1, mp.spawn does not (DataLoader workers run one thread each)",
    when=(
        "no error: more processes make training slower, top shows 100% on every core "
        "(mp.spawn, or a launcher that does not set OMP_NUM_THREADS)"
    ),
    fix=(
        "torchrun (it sets OMP_NUM_THREADS=1 for nproc_per_node > 1 and says so), or set "
        "OMP_NUM_THREADS = cores // processes before mp.spawn"
    ),
)
def too_many_threads(ctx: Ctx) -> None:
    cores = len(os.sched_getaffinity(0))
    with ctx.rank0("launches without OMP_NUM_THREADS") as mine:
        if not mine:
            return
        unset = {"OMP_NUM_THREADS": None}  # as in a fresh shell
        spawn = [sys.executable, "-m", "common.exhibits.worker", "threads_spawn", "2"]
        code, out = ctx.launch(spawn, 90, unset)
        spawned = _thread_counts(out)
        ctx.step("symptom", f"mp.spawn of 2 processes on {cores} cores, OMP_NUM_THREADS unset:")
        for line in sorted(re.findall(r"rank \d+: torch threads .*", out)):
            ctx.say(f"    {line}")
        ctx.record("symptom", spawned)
        alone = int((re.findall(r"one process alone: torch threads (\d+)", out) or ["0"])[0])
        total = sum(t for t, _ in spawned)
        ctx.claim(
            "broken_threads_vs_alone",
            total / alone if alone and len(spawned) == 2 else 0.0,
            "==",
            2.0,
            "threads of 2 processes / of one alone ({alone}): {value:g} ({total} threads on {cores} cores)",
            alone=alone,
            total=total,
            cores=cores,
        )
        ctx.step(
            "diagnosis",
            "torch.get_num_threads() in each process, times processes; a DataLoader worker "
            "sets itself to one thread",
        )
        ctx.claim(
            "dataloader_worker_threads",
            max((w for _, w in spawned), default=0),
            "==",
            1,
            "threads of a DataLoader worker: {value}",
        )
        torchrun = [
            *TORCHRUN,
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "common.exhibits.worker",
            "threads",
        ]
        code, out = ctx.launch(torchrun, 90, unset)
        launched = _thread_counts(out)
        ctx.step(
            "fix",
            "torchrun (it sets OMP_NUM_THREADS=1 for nproc_per_node > 1 and says so), or set "
            "OMP_NUM_THREADS = cores // processes before mp.spawn",
        )
        for line in sorted(re.findall(r"rank \d+: torch threads .*", out)):
            ctx.say(f"    {line}")
        per_process = max(t for t, _ in launched) if len(launched) == 2 else 0
        ctx.claim(
            "fixed_threads_per_process",
            per_process,
            "==",
            1,
            "torch threads per process under torchrun: {value}",
        )
