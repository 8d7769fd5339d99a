"""Lesson 12's exhibits of loading mistakes: a DataLoader given a sampler and shuffle=True, torch.load of a
checkpoint written on GPU 0 without map_location (every rank's copy lands on GPU 0), and a backend the build
of torch lacks (NCCL on Windows or a CPU-only build).

Each runs in milliseconds (the last on 2 ranks or more, the others in one process too). See `common.exhibits.frame` for the frame.
"""

from __future__ import annotations

import io
import zipfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from common.exhibits.frame import Ctx, exhibit


@exhibit(
    "sampler_with_shuffle",
    "training",
    lesson="04",
    symptom="ValueError: sampler option is mutually exclusive with shuffle",
    when="from DataLoader(dataset, sampler=DistributedSampler(dataset), shuffle=True)",
    cause="the DataLoader shuffles by building its own RandomSampler; given a sampler, the order is "
    "the sampler's, so both at once is refused",
    fix="shuffle in the sampler: DistributedSampler(dataset, shuffle=True) and "
    "DataLoader(shuffle=False, the default)",
)
def sampler_with_shuffle(ctx: Ctx) -> None:
    n, world, rank = 16, ctx.info.world_size, ctx.info.rank
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=0)
    o = ctx.attempt(DataLoader, range(n), batch_size=4, sampler=sampler, shuffle=True)
    ctx.step("symptom", "DataLoader(dataset, sampler=DistributedSampler(dataset), shuffle=True):")
    ctx.say(f"    {o.error}")
    ctx.record("symptom", o.error)
    ctx.claim(
        "broken_raises",
        int("mutually exclusive with shuffle" in (o.error or "")),
        "==",
        1,
        "the DataLoader refuses a sampler beside shuffle=True: {value}",
    )
    ctx.step(
        "diagnosis",
        "DistributedSampler already shuffles (shuffle=True is its default, with seed + epoch)",
    )
    shards = [
        [int(i) for b in DataLoader(range(n), batch_size=4, sampler=s) for i in b]
        for s in (
            DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=0)
            for r in range(world)
        )
    ]
    ctx.step(
        "fix",
        "shuffle in the sampler: DistributedSampler(dataset, shuffle=True) and "
        f"DataLoader(shuffle=False, the default); rank 0 reads {shards[0]}",
    )
    ctx.claim(
        "fixed_each_sample_once",
        len({i for shard in shards for i in shard}),
        "==",
        n,
        "distinct samples over the shuffled shards of {world} rank(s): {value} of {n}",
        world=world,
        n=n,
    )


def _written_on_gpu0(state: dict) -> bytes:
    """`torch.save(state)` as a process on cuda:0 writes it: every storage tagged with the device it came
    from. On a machine without a GPU the tags of a CPU save are rewritten to 'cuda:0' (the pickle in the
    checkpoint's zip holds each storage's tag as a string)."""
    buf = io.BytesIO()
    if torch.cuda.is_available():
        torch.save({k: v.to("cuda:0") for k, v in state.items()}, buf)
        return buf.getvalue()
    torch.save(state, buf)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("/data.pkl"):  # BINUNICODE: 'X', a 4-byte length, the text
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            dst.writestr(info, data)
    return out.getvalue()


@exhibit(
    "torch_load_without_map_location",
    "training",
    lesson="15",
    symptom="RuntimeError: Attempting to deserialize object on a CUDA device but "
    "torch.cuda.is_available() is False.",
    when="on a CPU-only machine; with GPUs, no error: every rank's copy lands on GPU 0 "
    "(nvidia-smi lists every rank's process on GPU 0, whose memory runs out first)",
    cause="torch.load puts each tensor back on the device it was saved from (rank 0 saved from "
    "cuda:0), unless map_location says where",
    fix="torch.load(path, map_location=device), device = cuda:LOCAL_RANK (or 'cpu')",
)
def torch_load_without_map_location(ctx: Ctx) -> None:
    blob = _written_on_gpu0({"weight": torch.ones(2, 2)})
    tags: list[str] = []

    def where(storage, location):  # map_location as a function: told each storage's saved device
        tags.append(location)
        return storage

    torch.load(io.BytesIO(blob), map_location=where)
    o = ctx.attempt(torch.load, io.BytesIO(blob))
    landed = o.error or f"finished: weight on {o.value['weight'].device}"
    ctx.step("symptom", "every rank: torch.load(a checkpoint rank 0 saved from cuda:0):")
    ctx.say(f"    {landed.split(' If you')[0]}")
    ctx.record("symptom", landed)
    ctx.step(
        "diagnosis",
        f"map_location=lambda storage, loc: print(loc) prints the saved device: {tags}",
    )
    on_gpu0 = ctx.gather(int(tags == ["cuda:0"]))
    ctx.claim(
        "broken_lands_on_gpu0",
        sum(on_gpu0),
        "==",
        ctx.info.world_size if on_gpu0 else 0,
        "ranks whose copy would land on cuda:0 without map_location: {value}",
    )
    device = torch.device(f"cuda:{ctx.info.local_rank}" if torch.cuda.is_available() else "cpu")
    fixed = torch.load(io.BytesIO(blob), map_location=device)
    ctx.step(
        "fix",
        "torch.load(path, map_location=device), device = cuda:LOCAL_RANK (or 'cpu'): "
        f"weight on {fixed['weight'].device}",
    )
    ctx.claim(
        "fixed_on_own_device",
        int(fixed["weight"].device == device),
        "==",
        1,
        "with map_location the weight is on this rank's device ({device}): {value}",
        device=str(device),
    )


@exhibit(
    "nccl_not_built_in",
    "training",
    min_world=2,
    lesson="03",
    symptom="RuntimeError: Distributed package doesn't have NCCL built in",
    when='from init_process_group("nccl") on Windows or with a CPU-only build of torch',
    cause="NCCL exists for Linux with CUDA only: the Windows builds and the CPU-only builds of torch "
    "have none",
    fix='backend="gloo" (the lessons pick it on CPU; --backend gloo), or WSL2 with a Linux CUDA build',
)
def nccl_not_built_in(ctx: Ctx) -> None:
    built = dist.is_nccl_available()
    ctx.step("symptom", f"dist.new_group(backend='nccl') here (dist.is_nccl_available(): {built}):")
    if built:  # a Linux CUDA build: the error shows on Windows and on CPU-only builds
        ctx.say("    this build has NCCL: nothing to show")
    else:
        timeout = timedelta(seconds=ctx.timeout_s)
        o = ctx.attempt(dist.new_group, backend="nccl", timeout=timeout)
        ctx.say(f"    {o.error}")
        ctx.record("symptom", o.error)
        ctx.claim(
            "broken_raises",
            int("doesn't have NCCL built in" in (o.error or "")),
            "==",
            1,
            "a build without NCCL refuses backend='nccl': {value}",
        )
    ctx.step(
        "diagnosis",
        "dist.is_nccl_available() and dist.is_gloo_available() say which backends this build has",
    )
    ones = torch.ones(1)
    dist.all_reduce(ones, group=ctx.group())
    ctx.step(
        "fix",
        'backend="gloo" (the lessons pick it on CPU; --backend gloo), or WSL2 with a Linux CUDA build: '
        f"all_reduce of ones over gloo gives {ones.item():g}",
    )
    ctx.claim(
        "fixed_gloo_sums",
        ones.item(),
        "==",
        ctx.info.world_size,
        "all_reduce of ones over gloo: {value:g} (world_size)",
    )
