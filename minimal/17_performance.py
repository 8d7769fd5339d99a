"""Minimal 17: where a DDP step's time goes -- one step under torch.profiler, its bucket all-reduces counted.

    torchrun --standalone --nproc_per_node=2 minimal/17_performance.py
    python minimal/17_performance.py                                # plain python: a world of one

DDP all-reduces each gradient bucket as soon as its last gradient is ready, during backward. The profiler
sees every one: the trace's `c10d::allreduce_` events (the reducer enqueuing a bucket; record_shapes gives
its numel, not its dtype) and the backend's own `gloo:all_reduce` / NCCL kernels. bucket_cap_mb=1 cuts the
2.2 MB of gradient into 3 buckets: 3 all-reduces per step, 2,182,184 bytes in all. Lesson:
lessons/17_performance.py (more steps, the overlap, each knob counted, torch.compile).
"""

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

DTYPE_BYTES = {
    "float": 4,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "double": 8,
}  # the trace's dtype names


class ResidualMLP(nn.Module):
    """The lessons' ResidualMLP(256, 4): 545,546 fp32 parameters, x (B, 1, 8, 8) -> logits (B, 10)."""

    def __init__(self, width=256, depth=4):
        super().__init__()
        self.stem = nn.Linear(64, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
            for _ in range(depth)
        )
        self.head = nn.Sequential(nn.GELU(), nn.Linear(width, 10))

    def forward(self, x):
        h = self.stem(x.flatten(1))  # (B, 256)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def step(model, opt, x, y) -> None:
    with record_function("forward"):
        loss = F.cross_entropy(model(x), y)
    with record_function("backward"):
        loss.backward()  # DDP's hooks all-reduce each bucket here, while backward runs on
    with record_function("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)


def bucket_allreduces(trace_path: Path) -> list[int]:
    """The elements of each bucket the trace shows the reducer all-reducing, in order of issue."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    issued = [e for e in events if e.get("name") == "c10d::allreduce_"]  # one per bucket
    # args "Input Dims" [[[numel]], ...]: the bucket is one flat tensor; "Input type" says only TensorList
    return [e["args"]["Input Dims"][0][0][0] for e in sorted(issued, key=lambda e: e["ts"])]


def main() -> None:
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # the device on this node; RANK is global
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: NCCL binds this process to its GPU
    if "RANK" not in os.environ:  # plain python: what torchrun would set, for a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT="0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # reads those variables
    try:
        torch.manual_seed(0)  # the same initial weights on every rank
        raw_model = ResidualMLP().to(device)
        ids = [local_rank] if device.type == "cuda" else None
        model = DDP(raw_model, device_ids=ids, bucket_cap_mb=1.0)  # 1 MB buckets: 3 of them
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(rank)  # this rank's own batch: x (32, 1, 8, 8), y (32,)
        x = torch.rand(32, 1, 8, 8, generator=g).to(device)
        y = torch.randint(0, 10, (32,), generator=g).to(device)
        for _ in range(2):  # warm-up: DDP rebuilds its buckets in gradient-ready order after step 1
            step(model, opt, x, y)
        activities = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if device.type == "cuda" else []
        )
        with profile(activities=activities, record_shapes=True) as prof:
            step(model, opt, x, y)
        trace = Path(tempfile.mkdtemp()) / f"trace_rank{rank}.json"  # open it in ui.perfetto.dev
        prof.export_chrome_trace(str(trace))
        numels = bucket_allreduces(trace)
        # a bucket holds gradients in the parameters' dtype (fp32: 4 bytes), as many as the trace says
        sent = [n * next(raw_model.parameters()).element_size() for n in numels]
        params = sum(p.numel() * p.element_size() for p in raw_model.parameters())
        mine = {"rank": rank, "allreduces": len(sent), "bucket_bytes": sent, "bytes": sum(sent)}
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, mine)  # every rank's count, printed by rank 0 in order
        if rank == 0:
            print(json.dumps({"param_bytes": params, "ranks": per_rank}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
