"""Workers for tests/unit/test_profiling.py (spawned by tests._workers.run_world; must be importable)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP


def hooks_on_gloo(rank: int, world_size: int):
    """A small DDP model on gloo: gradients after the bf16 and fp16 hooks against the plain all-reduce hook, the
    all-reduce calls counted against `predicted_buckets`, and the storage bytes with and without
    gradient_as_bucket_view."""
    from common.compression.hooks import comm_hook
    from common.models import mlp
    from common.performance.buckets import (
        allreduces_per_backward,
        gradient_storage_bytes,
        predicted_buckets,
    )

    def model(**kw):
        torch.manual_seed(0)
        return DDP(mlp([64, 256, 256, 10]), **kw)

    torch.manual_seed(1 + rank)  # each rank its own data
    x, y = torch.randn(8, 64), torch.randint(10, (8,))
    grads = {}
    for hook in ("allreduce", "bf16", "fp16"):
        m = model()
        fn, state = comm_hook(hook)
        m.register_comm_hook(state, fn)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        grads[hook] = torch.cat([p.grad.flatten() for p in m.parameters()])
    rel = {
        h: ((grads[h] - grads["allreduce"]).abs().max() / grads["allreduce"].abs().max()).item()
        for h in ("bf16", "fp16")
    }
    counts = {}
    for cap in (None, 0.1, 0.3):
        m = model(bucket_cap_mb=cap)
        counts[cap] = (allreduces_per_backward(m, (x, y), steps=2)[0], predicted_buckets(m))
    storage = {
        v: gradient_storage_bytes(model(gradient_as_bucket_view=v), (x, y)) for v in (False, True)
    }
    return {
        "rel": rel,
        "counts": counts,
        "storage": storage,
        "param_bytes": sum(p.numel() * 4 for p in mlp([64, 256, 256, 10]).parameters()),
    }
