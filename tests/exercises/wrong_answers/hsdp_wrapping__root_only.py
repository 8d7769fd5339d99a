"""Wrong: only the root wrapped: one unit, so every parameter is gathered at once (no per-block units)."""

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def shard_hsdp(model, world_size, replicate):
    dims = (replicate, world_size // replicate)
    mesh = init_device_mesh("cpu", dims, mesh_dim_names=("dp_replicate", "dp_shard"))
    return fully_shard(model, mesh=mesh)
