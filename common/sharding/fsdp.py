"""FSDP2 in practice: the model, the wrapping, the predicted bytes and an initialisation that equals eager (14).

- `NormalisedMLP`: lesson 13's ResidualMLP with two buffers in front, a persistent `pixel_mean` (in the state
  dict) and a non-persistent `pixel_scale` (not in it, as RoPE's frequencies are not), so that a model built
  on the meta device has something besides parameters to initialise, and a load that skips it shows.
- `shard_blocks_then_root(model, mesh, **kw)`: `fully_shard` each block (its own all-gather and
  reduce-scatter), then the root (stem and head); on a 2-D mesh (replicate, shard) that is HSDP.
- `fsdp_units(model)`: the parameters of each of those units, blocks first, the root last.
- `padded_bytes(params, shard)`: FSDP2 shards each parameter on dim 0 in `shard` equal chunks, so an
  all-gather's output is each parameter with its rows padded to a multiple of `shard`:
      sum over parameters of ceil(rows / shard) x shard x (elements per row) x element size.
- `predicted_step_bytes(...)`: the bytes one training step hands to each collective, from those shapes.
- `param_groups(model)`: FSDP2's FSDPParamGroup of each unit; `exact_mean_gradients(model, x, y)`: the local
  gradients the reduce-scatter would be handed, averaged over ranks in float64 (a reduction's error is
  measured against it). Prefetching: common/sharding/prefetch.py.
- `meta_sharded(width, depth, mesh, device)`: built on the meta device, sharded, `to_empty`;
  `reset_sharded(model, seed)`: `reset_parameters()` on its DTensors (each rank draws its own shard).
- `full_values(model)`: every parameter in full, then every buffer: what "equal to eager" compares.
- `init_like_eager(model, seed)`: the sharded model's values equal to `NormalisedMLP(...)` built eagerly after
  `torch.manual_seed(seed)`, holding one full layer at a time; buffers included.

One step measured and training on sharded slices: common/sharding/fsdp_steps.py.

Source: pytorch.org/docs/stable/distributed.fsdp.fully_shard.html; torchtitan's `parallelize_llama`.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from common.models import ResidualMLP
from common.sharding.accounting import full_params

__all__ = [
    "NormalisedMLP",
    "shard_blocks_then_root",
    "fsdp_units",
    "padded_bytes",
    "predicted_step_bytes",
    "init_like_eager",
    "full_values",
    "param_groups",
    "exact_mean_gradients",
    "meta_sharded",
    "reset_sharded",
]


class NormalisedMLP(ResidualMLP):
    """ResidualMLP on (x - pixel_mean) * pixel_scale. x (B, 1, 8, 8) or (B, 64) -> logits (B, 10).

    pixel_mean (64,) is persistent (saved and loaded with the state dict); pixel_scale (64,) is not: after
    `to_empty` or a state-dict load only `init_buffers()` gives it its values again.
    """

    def __init__(self, width: int = 32, depth: int = 2):
        super().__init__(width, depth)
        self.register_buffer("pixel_mean", torch.empty(64))
        self.register_buffer("pixel_scale", torch.empty(64), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """The buffers' values, from a formula (no random numbers: the same on every rank and every device)."""
        with torch.no_grad():
            self.pixel_mean.copy_(torch.linspace(0.0, 0.5, 64))
            self.pixel_scale.copy_(torch.linspace(1.0, 2.0, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x.flatten(1) - self.pixel_mean) * self.pixel_scale
        # FSDP2 casts parameters (MixedPrecisionPolicy), never buffers: back to the weights' dtype
        return super().forward(h.to(self.stem.weight.dtype))


def shard_blocks_then_root(model: ResidualMLP, mesh, **kw) -> ResidualMLP:
    """fully_shard each block, then the root (stem and head), all with the same options `kw`."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def fsdp_units(model: ResidualMLP) -> list[list[nn.Parameter]]:
    """The parameters of each fully_shard unit: each block's, then the root's (stem and head)."""
    blocks = [list(b.parameters()) for b in model.blocks]
    return [*blocks, [*model.stem.parameters(), *model.head.parameters()]]


def padded_bytes(params, shard: int, element_size: int = 4) -> int:
    """Bytes of `params` with each one's rows (dim 0) padded to a multiple of `shard`."""
    total = 0
    for p in params:
        rows = p.shape[0]
        total += -(-rows // shard) * shard * (p.numel() // rows) * element_size
    return total


def predicted_step_bytes(
    model: ResidualMLP,
    shard: int,
    replicate: int = 1,
    gathers: tuple[int, int] = (2, 1),
    param_size: int = 4,
    reduce_size: int = 4,
) -> dict[str, int]:
    """The bytes one step hands to each collective (a call's full buffer, as `count_collectives` counts it).

    Per unit U (padded to `shard`): all-gather U in the parameter dtype, `gathers[0]` times for a block
    (forward, and backward again after a reshard) and `gathers[1]` for the root (by default FSDP2 does not
    reshard the root after forward: backward needs it at once); reduce-scatter U in the reduce dtype, once;
    with replicas (HSDP) all-reduce the reduced shard, U / shard, once. Without replicas no all-reduce.
    """
    block_units, root = fsdp_units(model)[:-1], fsdp_units(model)[-1]
    ag = sum(gathers[0] * padded_bytes(u, shard, param_size) for u in block_units)
    ag += gathers[1] * padded_bytes(root, shard, param_size)
    rs = sum(padded_bytes(u, shard, reduce_size) for u in fsdp_units(model))
    ar = (
        rs // shard
    )  # the reduced shard, all-reduced across replicas: computed before a shard of 1 zeroes rs
    if shard == 1:  # a shard group of one rank: nothing to gather or scatter
        ag = rs = 0
    out = {"all_gather_single": ag, "reduce_scatter_single": rs}
    if replicate > 1:
        out["all_reduce"] = ar
    return out


def init_like_eager(model: ResidualMLP, seed: int) -> int:
    """Give a sharded (or plain) model the values `NormalisedMLP` has when built after manual_seed(seed).

    Eager construction draws each Linear's weight, then bias, in module order, on the CPU (the lessons build
    the eager model there and move it). Here each rank draws the same numbers on the CPU's generator, one full
    Linear at a time, and keeps its shard (`distribute_tensor(..., src_data_rank=None)` moves it to the mesh's
    device type; no communication, each rank slices its own copy): one layer in full at most. Then the
    buffers. (`reset_parameters()` on DTensor parameters draws each shard from the rank's own generator on a
    CPU: other values; lesson 14 measures how far.) Returns the largest full layer's bytes held.
    """
    torch.manual_seed(seed)
    largest = 0
    with torch.no_grad():
        for m in model.modules():
            if not isinstance(m, nn.Linear):
                continue
            full = nn.Linear(
                m.in_features, m.out_features, device="cpu"
            )  # eager's draw, on the CPU
            largest = max(largest, 4 * sum(p.numel() for p in full.parameters()))
            for mine, theirs in ((m.weight, full.weight), (m.bias, full.bias)):
                if isinstance(mine, DTensor):
                    part = distribute_tensor(
                        theirs, mine.device_mesh, mine.placements, src_data_rank=None
                    )
                    mine.to_local().copy_(part.to_local())
                else:
                    mine.copy_(theirs.to(mine.device))
    model.init_buffers()
    return largest


def param_groups(model: nn.Module) -> list:
    """The FSDPParamGroup of each fully_shard unit in `model` (FSDP2's internal objects: no public API)."""
    states = [m._get_fsdp_state() for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    return [st._fsdp_param_group for st in states if st._fsdp_param_group is not None]


def exact_mean_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """What a reduction without rounding gives: one forward and backward of `model` on this rank's (x, y) with
    gradient sync off, then each parameter's local gradient (unsharded, not reduced: what the reduce-scatter
    would be handed, in the reduce dtype) averaged over the ranks in float64, in `model.parameters()` order.
    A collective: every rank calls it."""
    model.set_requires_gradient_sync(False)
    F.cross_entropy(model(x), y).backward()
    held = {}
    for group in param_groups(model):
        for fp in group.fsdp_params:
            acc = fp.unsharded_accumulated_grad
            grad = acc if acc is not None else fp._unsharded_param.grad
            held[id(fp.sharded_param)] = grad.double()
    for t in held.values():
        dist.all_reduce(t)  # float64: the sum of the same numbers, exact to ~1e-16
    return [held[id(p)] / dist.get_world_size() for p in model.parameters()]


def meta_sharded(width: int, depth: int, mesh, device: torch.device) -> NormalisedMLP:
    """NormalisedMLP built on the meta device (shapes only: no memory, no random numbers drawn), sharded by
    `shard_blocks_then_root`, then `to_empty`: each rank allocates its shards and buffers, uninitialised."""
    with torch.device("meta"):
        model = NormalisedMLP(width, depth)
    shard_blocks_then_root(model, mesh)
    return model.to_empty(device=device)


def reset_sharded(model: NormalisedMLP, seed: int) -> NormalisedMLP:
    """The obvious initialisation of a meta-built model: `reset_parameters()` of each Linear after
    manual_seed(seed), then the buffers. On DTensor parameters each rank's generator draws its own shard."""
    torch.manual_seed(seed)
    with (
        warnings.catch_warnings()
    ):  # "DTensor random operators may not have complete support on cpu"
        warnings.simplefilter("ignore", UserWarning)
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
    model.init_buffers()
    return model


def full_values(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter in full (a DTensor all-gathered: every rank calls it), then every buffer, non-persistent
    ones included: what an initialisation must get right."""
    return [*full_params(model), *(b.detach() for b in model.buffers())]
