"""Wrong: the dims swapped, (world_size // replicate, replicate) named ("dp_shard", "dp_replicate"): on 2 x 2
the same groups (fully_shard replicates over dim 0 whatever its name), a mesh whose names say the opposite."""

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def shard_hsdp(model, world_size, replicate):
    dims = (world_size // replicate, replicate)
    mesh = init_device_mesh("cpu", dims, mesh_dim_names=("dp_shard", "dp_replicate"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)
