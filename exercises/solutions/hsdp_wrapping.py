"""Reference solution of exercises/hsdp_wrapping.py (lesson 14)."""

from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def shard_hsdp(model: nn.Module, world_size: int, replicate: int) -> nn.Module:
    # outer dim first: fully_shard replicates over dim 0 and shards over dim 1, whatever their names
    dims = (replicate, world_size // replicate)
    mesh = init_device_mesh("cpu", dims, mesh_dim_names=("dp_replicate", "dp_shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)  # its own all-gather and reduce-scatter
    return fully_shard(model, mesh=mesh)  # the root: the stem and the head
