"""Minimal 15: a sharded checkpoint (torch.distributed.checkpoint) that another number of ranks loads.

    torchrun --standalone --nproc_per_node=4 minimal/15_checkpoints.py
    python minimal/15_checkpoints.py                                # plain python: a world of one

Each rank dcp.saves what it holds (FSDP2: its shards; DDP: a replica, written once); rank 0 writes COMPLETE
last. Ranks 0 .. N/2-1, a group of their own, load both resharded: exactly what was saved. Lesson 15."""

import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP


def make_model(seed: int, device, w: int = 33) -> nn.Module:
    """x (B, 64) -> logits (B, 10); the shapes of lesson 13's ResidualMLP(33, 2): 6973 parameters."""
    torch.manual_seed(seed)  # the same values on every rank
    layers = [nn.Linear(64, w), nn.Linear(w, w), nn.Linear(w, w), nn.Linear(w, w), nn.Linear(w, w)]
    return nn.Sequential(*layers, nn.GELU(), nn.Linear(w, 10)).to(device)


def save(model, optimizer, path: str, rank: int) -> None:
    """Every rank writes its own file (__R_0.distcp); rank 0 marks the folder complete, last."""
    model_sd, optim_sd = get_state_dict(model, optimizer)  # FSDP2: DTensors, this rank's shards
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    dist.barrier()  # every rank's files are written
    if rank == 0:  # atomic: a crash leaves no half-written marker
        torch.save({}, os.path.join(path, "COMPLETE.tmp"))  # written, flushed, closed
        os.replace(os.path.join(path, "COMPLETE.tmp"), os.path.join(path, "COMPLETE"))


def load(model, optimizer, path: str, group) -> None:
    """Each rank of `group` reads the chunks that overlap what it holds, whoever wrote them."""
    assert os.path.exists(os.path.join(path, "COMPLETE")), f"{path}: an unfinished save"
    model_sd, optim_sd = get_state_dict(model, optimizer)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=path, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def whole(m) -> list[torch.Tensor]:
    """The whole parameters (an FSDP2 DTensor is all-gathered: every rank of its mesh calls this)."""
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in m.parameters()]


def diff(a, b) -> float:  # max |a - b|; torch's max keeps a NaN (Python's max may drop it)
    return torch.stack([(x - y).abs().max() for x, y in zip(a, b)]).max().item()


def train(model, optimizer, rank: int, world_size: int, device, steps: int = 2) -> None:
    for step in range(steps):  # global batches of 64 random digits-shaped inputs, 64 / N per rank
        torch.manual_seed(step)  # drawn on the CPU: the same numbers on any device
        x, y = torch.randn(64, 64).to(device), torch.randint(10, (64,)).to(device)
        F.cross_entropy(model(x[rank::world_size]), y[rank::world_size]).backward()  # 1/N each
        optimizer.step()
        optimizer.zero_grad()


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
        folder = [tempfile.mkdtemp() if rank == 0 else None]
        dist.broadcast_object_list(folder)  # one folder for every rank
        fsdp_path, ddp_path = os.path.join(folder[0], "fsdp2"), os.path.join(folder[0], "ddp")
        # --- N ranks train and save: FSDP2 (each rank 1/N of every tensor), DDP (replicas) ---
        mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
        model = fully_shard(make_model(0, device), mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        train(model, optimizer, rank, world_size, device)
        local = [p.to_local() for p in model.parameters()]
        local += [t.to_local() for s in optimizer.state.values() for t in s.values() if t.dim()]
        my_bytes = sum(t.numel() * t.element_size() for t in local)  # what this rank's file holds
        save(model, optimizer, fsdp_path, rank)
        saved_fsdp = whole(model)
        replica = DDP(make_model(0, device))  # on a GPU: device_ids=None, the module's device
        ddp_optimizer = torch.optim.Adam(replica.parameters(), lr=1e-3)
        train(replica, ddp_optimizer, rank, world_size, device)
        save(replica.module, ddp_optimizer, ddp_path, rank)
        saved_ddp = whole(replica.module)
        # --- a world of M = N/2 ranks (a process group of its own) loads both, resharded ---
        ranks = list(range(max(1, world_size // 2)))
        group = dist.new_group(ranks)  # every rank of the world calls new_group
        if rank in ranks:
            mesh = DeviceMesh.from_group(group, device.type)
            model = fully_shard(make_model(1, device), mesh=mesh)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
            load(model, optimizer, fsdp_path, group)
            plain = make_model(1, device)  # every loading rank gets all of DDP's replica
            load(plain, torch.optim.Adam(plain.parameters(), lr=1e-3), ddp_path, group)
            fsdp_diff, ddp_diff = diff(whole(model), saved_fsdp), diff(whole(plain), saved_ddp)
            assert fsdp_diff == 0.0 and ddp_diff == 0.0, (fsdp_diff, ddp_diff)  # NaN fails too
            result = {"fsdp2_max_diff": fsdp_diff, "ddp_max_diff": ddp_diff}  # rank 0 is here
        bytes_per_rank = [None] * world_size
        dist.all_gather_object(bytes_per_rank, my_bytes)
        if rank == 0:
            files = sorted(f for f in os.listdir(fsdp_path) if f.endswith(".distcp"))
            out = {"saved_by": world_size, "loaded_by": len(ranks), "files": files}
            print(json.dumps({**out, **result, "shard_bytes_per_rank": bytes_per_rank}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
