"""Sharding through the libraries (23): counted training steps of a fully_shard model, and what Accelerate's
FSDP2 plugin does on this machine (its FSDP path is taken on GPU-like distributed types only: on CPU a
fresh Accelerator with it raises ValueError, its state being MULTI_CPU), recorded as text instead of assumed.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import FullyShardedDataParallelPlugin
from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy

from common.harness.env import DistInfo
from common.measure.counters import count_collectives
from common.models import ResidualMLP
from common.sharding.accounting import full_params
from common.sharding.fsdp import shard_blocks_then_root

__all__ = ["shard_run", "fabric_fully_shard", "accelerate_fsdp2_outcome"]


def shard_run(model, opt, batches) -> tuple[list, dict]:
    """Adam steps on this rank's batches, counted: (full parameters, calls). FSDP2 calls
    dist.all_gather_single and dist.reduce_scatter_single, which count_collectives sees."""
    with count_collectives() as c, warnings.catch_warnings():
        # the head's output is a view of its Linear's: FSDP2 warns about in-place ops on it; there are none
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        for x, y in batches:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return full_params(model), dict(c.calls)


def accelerate_fsdp2_outcome(info: DistInfo) -> tuple[str, bool]:
    """Accelerate's FSDP2 plugin with a ParallelismConfig, in a fresh Accelerator state: what it does
    here, as text, and whether it was the CPU refusal (ValueError: "... but got
    DistributedType.MULTI_CPU"). The library keeps one state per process (the first Accelerator's
    wins and later arguments are ignored): it is cleared before and after, as its own tests do."""
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    config = ParallelismConfig(dp_shard_size=info.world_size)
    AcceleratorState._reset_state(reset_partial_state=True)  # the process group itself stays
    GradientState._reset_state()
    try:  # on GPUs: fully_shard on the dp_shard dim
        accelerator = Accelerator(
            cpu=info.device.type == "cpu", fsdp_plugin=plugin, parallelism_config=config
        )
        wrapped = accelerator.prepare(ResidualMLP(33, 2).to(info.device))
        outcome = f"{accelerator.distributed_type.value}, prepare returns {type(wrapped).__name__}"
        refused = False
    except (ValueError, RuntimeError) as e:  # the library's refusal, recorded as text
        outcome = f"{type(e).__name__}: {e}"
        refused = isinstance(e, ValueError) and "but got DistributedType.MULTI_CPU" in str(e)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return outcome, refused


def fabric_fully_shard(info: DistInfo, init_state: dict, batches: list) -> tuple[list, list, dict]:
    """Fabric's ModelParallelStrategy twice: at its default sizes (only the mesh it builds is kept), then
    data_parallel_size = world_size, tensor_parallel_size = 1, calling fully_shard per block and root on
    mesh["data_parallel"], trained by `shard_run` from `init_state`. Returns ([(dim names, shape)] of both
    meshes, the full parameters after the steps, the collective calls)."""
    meshes = []

    def parallelize(model, mesh):  # Fabric calls this with the mesh it built
        meshes.append((mesh.mesh_dim_names, tuple(mesh.shape)))
        return shard_blocks_then_root(model, mesh["data_parallel"]) if len(meshes) > 1 else model

    W, kind = info.world_size, info.device.type
    default = Fabric(accelerator=kind, devices=W, strategy=ModelParallelStrategy(parallelize))
    default.launch()  # under torchrun: the process group that is already there
    default.setup_module(ResidualMLP(33, 2))
    sizes = ModelParallelStrategy(parallelize, data_parallel_size=W, tensor_parallel_size=1)
    fabric = Fabric(accelerator=kind, devices=W, strategy=sizes)
    fabric.launch()
    model = ResidualMLP(33, 2).to(info.device)
    model.load_state_dict(init_state)
    model = fabric.setup_module(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    params, calls = shard_run(model, opt, batches)
    return meshes, params, calls
