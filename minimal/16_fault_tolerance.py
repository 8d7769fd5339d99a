"""Minimal 16: fault tolerance -- the whole training state saved atomically, resumed bit for bit.

    torchrun --standalone --nproc_per_node=2 minimal/16_fault_tolerance.py
    python minimal/16_fault_tolerance.py                            # plain python: a world of one

A resumed run equals one that never stopped only if the checkpoint holds all a step reads: model,
AdamW's moments, LR schedule, every rank's random stream (dropout), the step (so the sampler's epoch
and position), written atomically. Lesson: lessons/16_fault_tolerance.py (real crashes, restarts).
"""

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

B, STEPS = 16, 18  # samples per rank per step, steps: 192 samples on 2 ranks -> 6 steps per epoch


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


def fit(args, rank, world_size, device, until, save_to=None, resume_from=None):
    """Build all as at step 0 (or load `resume_from`), train to step `until`, save to `save_to`."""
    x, y = (t[:192].to(device) for t in load_digits())  # lesson 16's 192 training digits
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    # lesson 16's model: two hidden layers of 64 with dropout
    hidden = [[nn.Linear(64, 64), nn.ReLU(), nn.Dropout(args.dropout)] for _ in range(2)]
    raw_model = nn.Sequential(nn.Flatten(), *hidden[0], *hidden[1], nn.Linear(64, 10))
    model = DDP(raw_model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(raw_model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
    torch.manual_seed(args.seed + 1 + rank)  # dropout masks differ by rank
    start, losses = 0, []
    if resume_from:  # --- restore ALL of it ---
        state = torch.load(resume_from, map_location="cpu", weights_only=True)
        raw_model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"][rank][0])  # this rank's streams
        if device.type == "cuda":  # dropout on a GPU draws from the GPU's generator
            torch.cuda.set_rng_state(state["rng"][rank][1], device)
        start = state["step"]
    for step in range(start, until):  # --- the training loop, a DistributedSampler by hand ---
        epoch, k = divmod(step, len(y) // (world_size * B))  # the sampler's epoch and position
        g = torch.Generator().manual_seed(args.seed + epoch)  # the epoch's order, on every rank
        i = torch.randperm(len(y), generator=g)[rank::world_size][k * B : (k + 1) * B]  # my batch k
        loss = F.cross_entropy(model(x[i]), y[i])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    if save_to:  # --- save ALL of it, atomically ---
        rngs, mine = [None] * world_size, [torch.get_rng_state()]
        if device.type == "cuda":
            mine.append(torch.cuda.get_rng_state(device))
        dist.all_gather_object(rngs, mine)  # every rank's streams, in rank order
        if rank == 0:
            state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict()}
            state.update(scheduler=scheduler.state_dict(), rng=rngs, step=until)
            torch.save(state, save_to.with_suffix(".tmp"))
            os.replace(save_to.with_suffix(".tmp"), save_to)  # the old file or the new, never half
        dist.barrier()  # nobody goes on before the checkpoint is complete
    return raw_model, losses


def train(args, rank, world_size, device) -> None:
    ckpt = Path(os.environ.get("TMPDIR", "/tmp"), f"min16_{os.environ.get('MASTER_PORT', 0)}.pt")
    _, before = fit(args, rank, world_size, device, 10, save_to=ckpt)  # stop at 10, then "crash"
    resumed, after = fit(args, rank, world_size, device, STEPS, resume_from=ckpt)
    ref, _ = fit(args, rank, world_size, device, STEPS)  # never stopped
    # --- the check: bit for bit on 1-2 ranks; on 3+ a new DDP's first bucket adds in another order ---
    got, want = (torch.cat([p.detach().flatten() for p in m.parameters()]) for m in (resumed, ref))
    diff = (got - want).abs().max().item()  # every rank checks its own replica below
    if rank == 0:  # one JSON line; with --dropout 0 the losses are lesson 16's (--no-random-draws)
        print(json.dumps({"resumed_at": 10, "max_diff": diff, "losses": before + after}))
        ckpt.unlink()
    torch.testing.assert_close(got, want, rtol=0, atol=0.0 if world_size <= 2 else 1e-6)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dropout", type=float, default=0.1, help="0: no random draws")
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
