"""Exercise (lesson 14): wrap a model for HSDP -- a 2-D mesh and the fully_shard calls.

Fill in `shard_hsdp`, then grade it:  python -m exercises hsdp_wrapping
(4 gloo ranks: the grader wraps lesson 13's ResidualMLP with your function, trains one step, and checks the
units, the parameters against one process, and which group each collective ran in).
"""

from torch import nn


def shard_hsdp(model: nn.Module, world_size: int, replicate: int) -> nn.Module:
    """Shard `model` (a ResidualMLP: `model.blocks`, then the stem and head) for HSDP on this CPU, and return it.

    Contract:
        - a 2-D DeviceMesh of `replicate` x `world_size // replicate` ranks on "cpu", dims named
          ("dp_replicate", "dp_shard"): parameters sharded inside each dp_shard group, replicated across
          dp_replicate (rank r's dp_shard group: the ranks of its row in arange(world_size).view(R, S));
        - one fully_shard unit per residual block, then the root (the stem and the head);
        - gradients reduced every step (the grader trains one plain step).

    Hint: torch.distributed.device_mesh.init_device_mesh, torch.distributed.fsdp.fully_shard. Which dim of the
    mesh does fully_shard replicate over: the one you name "dp_replicate", or the first one?
    """
    raise NotImplementedError("shard_hsdp")
