"""ZeRO by hand: each block's parameters in one flat, padded buffer, cut into N shards, and the three stages built
from two collectives, all-gather and reduce-scatter (lesson 13; benchmarks/sharding_speed.py).

    zero = ZeRO(model, [model.stem, *model.blocks, model.head], stage=3, group=grid.group("dp"), lr=1e-3)
    loss = F.cross_entropy(model(x), y)      # stage 3: each block all-gathers its parameters just before use
    loss.backward()                          # stages 2 and 3: each block's gradient is reduce-scattered as soon
    zero.step()                              # as it is complete; Adam updates this rank's 1/N slice only

A unit (one block) of n parameters lives in a flat buffer of N x ceil(n / N) elements; the last up to N - 1
elements are padding that belongs to no parameter (the model's parameters are views of flat[:n]), so padding
never reaches the model. Rank r owns flat[r*s:(r+1)*s], s = ceil(n / N), and keeps Adam's state for it alone.

    stage 1  optimizer state sharded. Backward leaves full gradients on every rank; step() reduce-scatters them
             (each rank receives the sum of its slice), Adam updates the slice, an all-gather rebuilds the flat.
    stage 2  + gradients sharded: a unit's gradient is reduce-scattered the moment backward completes it, then
             dropped, so at the end of backward a rank holds 1/N of the gradients.
    stage 3  + parameters sharded at rest: the flat buffer's storage is freed (resized to 0 bytes) and gathered
             again just before the unit's forward and again just before its backward (reshard after forward).

Bytes per step, per rank (Psi = the parameters' bytes): a ring all-reduce moves 2 Psi (N-1)/N, a reduce-scatter
or an all-gather Psi (N-1)/N each. DDP and stages 1-2: 2 Psi (N-1)/N; stage 3: 3 Psi (N-1)/N, 1.5x.
Rajbhandari et al. 2020, ZeRO (https://arxiv.org/abs/1910.02054), sections 5 and 7.
With world_size 1 (no group) the collectives become copies and every stage is plain Adam on the whole model.
Frozen parameters (requires_grad=False) are handled as DDP and torch.optim handle them: broadcast from rank 0 at
wrap time, then left out of the flat buffers (no gradient, no optimizer state, whole on every rank, untouched).
A parameter tied (shared) between modules must sit in one unit, as FSDP asks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from common.harness.env import LessonError

__all__ = [
    "flat_units",
    "STAGES",
    "check_stages",
    "check_world_size",
    "padded_sizes",
    "FlatUnit",
    "ZeRO",
]

STAGES = (1, 2, 3)


def check_stages(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]. Raises LessonError naming a stage that does not exist."""
    try:
        stages = [int(s) for s in str(text).split(",")]
    except ValueError:
        raise LessonError(f"--stages takes ZeRO stage numbers like 1,2,3; got {text!r}") from None
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise LessonError(
            f"ZeRO has stages 1, 2 and 3 (optimizer state, + gradients, + parameters); got {bad[0]}"
        )
    return sorted(set(stages))


def check_world_size(unit_numels: dict[str, int], world_size: int) -> None:
    """Every rank must own at least one real (not padding) element of every unit, or the split makes no sense.

    Shards hold s = ceil(n / N) elements, so the last rank owns n - (N - 1) s: 0 or less means a rank of pure
    padding (e.g. a unit of 4 elements over 3 ranks: shards of 2, the third rank owns none).
    """
    for name, n in unit_numels.items():
        s = math.ceil(n / world_size)
        if n - (world_size - 1) * s <= 0:
            raise LessonError(
                f"world size {world_size} cannot split unit {name!r} ({n} elements): shards of {s} "
                f"leave rank {world_size - 1} only padding; use at most {max(1, n // s)} ranks "
                "or a wider model"
            )


def padded_sizes(unit_numels: dict[str, int], world_size: int) -> dict[str, int]:
    """name -> elements of each unit's flat buffer: n padded to N x ceil(n / N), a whole shard per rank."""
    return {name: math.ceil(n / world_size) * world_size for name, n in unit_numels.items()}


def _all_gather(out: torch.Tensor, shard: torch.Tensor, group) -> None:
    if group is None:
        out.copy_(shard)
    else:
        # out (N * s,) <- every rank's shard (s,), in rank order; torch < 2.13 calls it all_gather_into_tensor.
        # Looked up at each call, so that common.measure.counters.count_collectives sees it.
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, shard, group=group)


def _reduce_scatter(out: torch.Tensor, full: torch.Tensor, group) -> None:
    if group is None:
        out.copy_(full)
    else:
        # out (s,) = sum over ranks of slice r; torch < 2.13 calls it reduce_scatter_tensor
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(
            out, full, op=dist.ReduceOp.SUM, group=group
        )


class FlatUnit:
    """One unit's parameters as views of one flat buffer of N x s elements, and this rank's shard of it.

    Attributes:
        params: the unit's parameters (views of `flat[:numel]` while gathered).
        numel, shard_numel, padded: n, s = ceil(n / N), N x s.
        flat: the full flat buffer (stage 3: its storage is 0 bytes between uses).
        shard: an nn.Parameter of s elements, what the optimizer updates. Stages 1-2: a view of this rank's slice
            of `flat` (no extra memory); stage 3: its own tensor, the only copy this rank keeps at rest.
    """

    def __init__(self, module: nn.Module, rank: int, world_size: int, group, stage: int):
        # trainable only: a frozen parameter gets no gradient, no optimizer state, no weight decay
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.group, self.rank, self.world_size, self.stage = group, rank, world_size, stage
        self.numel = sum(p.numel() for p in self.params)
        self.shard_numel = math.ceil(self.numel / world_size)
        self.padded = self.shard_numel * world_size
        p0 = self.params[0]
        self.flat = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)  # padding stays 0
        offset = 0
        for p in self.params:
            self.flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset : offset + p.numel()].view_as(
                p
            )  # the model now computes on the flat buffer
            offset += p.numel()
        if group is not None:  # as DDP at wrap time: every rank starts from rank 0's parameters
            dist.broadcast(self.flat, group=group, group_src=0)
        mine = self.flat[rank * self.shard_numel : (rank + 1) * self.shard_numel]
        self.shard = nn.Parameter(mine if stage < 3 else mine.clone())
        self._pending = 0  # parameters whose gradient backward has not finished yet (stages 2-3)
        if stage == 3:
            self.free()

    @property
    def gathered(self) -> bool:
        return self.flat.untyped_storage().nbytes() > 0

    def free(self) -> None:
        """Stage 3: drop the full parameters (the views stay valid; their storage is 0 bytes until `gather`)."""
        self.flat.untyped_storage().resize_(0)

    @torch.no_grad()
    def gather(self) -> None:
        """All-gather the shards into `flat`: every parameter of the unit is whole again (Psi_unit bytes)."""
        if not self.gathered:
            self.flat.untyped_storage().resize_(self.padded * self.flat.element_size())
        # stages 1-2: the shard is a view of flat, so send a copy (an all-gather whose input aliases its output is
        # allowed by NCCL but not promised by every backend)
        _all_gather(
            self.flat,
            self.shard.detach().clone() if self.stage < 3 else self.shard.detach(),
            self.group,
        )

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter the unit's gradient: this rank receives the mean over ranks of its slice; the full
        gradients are dropped (stage 2-3 call it from backward, stage 1 from `ZeRO.step`)."""
        full = torch.zeros(
            self.padded, dtype=self.flat.dtype, device=self.flat.device
        )  # padding gradient 0
        offset = 0
        for p in self.params:
            if p.grad is not None:
                full[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
            offset += p.numel()
            p.grad = None
        full.div_(self.world_size)  # as DDP does: divide by N, then sum
        out = torch.empty(self.shard_numel, dtype=full.dtype, device=full.device)
        _reduce_scatter(out, full, self.group)
        self.shard.grad = out if self.shard.grad is None else self.shard.grad.add_(out)

    def _grad_ready(self, _p: torch.Tensor) -> None:
        self._pending -= 1
        if self._pending == 0:  # the last of the unit's gradients is complete
            self.reduce_gradients()
            if self.stage == 3:
                self.free()

    def install_hooks(self, module: nn.Module) -> None:
        """Stages 2-3: reduce-scatter when the unit's gradients are complete. Stage 3: gather before forward, free
        after it, gather again when backward reaches the unit's output."""
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        module.register_forward_pre_hook(lambda m, args: self._before_forward())
        if self.stage == 3:
            module.register_forward_hook(lambda m, args, out: self._after_forward(out))

    def _before_forward(self) -> None:
        self._pending = len(self.params)
        if self.stage == 3:
            self.gather()

    def _after_forward(self, out: torch.Tensor) -> None:
        self.free()  # reshard after forward: the next unit's gather can reuse the memory
        if torch.is_tensor(out) and out.requires_grad:
            out.register_hook(
                lambda grad: self.gather()
            )  # fires before this unit's backward needs the weights


class ZeRO:
    """ZeRO stage 1, 2 or 3 over a data-parallel group: flat units, and Adam (or `optimizer_cls`) over the shards.

    Args:
        model: the plain module (not DDP). Its parameters become views of the units' flat buffers.
        units: modules whose parameters, together, are exactly the model's (e.g. stem, each block, head).
        stage: 1, 2 or 3.
        group: the data-parallel process group (`grid.group("dp")`); None for a world of one.
        optimizer_cls, **optimizer_kwargs: an element-wise optimizer (Adam, AdamW, SGD): it updates each shard as
            it would update those elements of the full model.
    """

    def __init__(
        self,
        model: nn.Module,
        units: Sequence[nn.Module],
        stage: int,
        group=None,
        optimizer_cls=torch.optim.Adam,
        **optimizer_kwargs,
    ):
        check_stages(str(stage))
        rank = dist.get_rank(group) if group is not None else 0
        world_size = dist.get_world_size(group) if group is not None else 1
        owned = [id(p) for u in units for p in u.parameters()]
        if sorted(owned) != sorted(id(p) for p in model.parameters()):
            raise LessonError(
                "the units' parameters must be exactly the model's, each in one unit (a parameter "
                "tied between two modules too: put both in one unit)"
            )
        self.model, self.stage = model, stage
        self.frozen = [p for p in model.parameters() if not p.requires_grad]
        if (
            group is not None
        ):  # DDP broadcasts frozen parameters at wrap time too; nothing changes them after
            for p in self.frozen:
                dist.broadcast(p.data, group=group, group_src=0)
        trainable = [u for u in units if any(p.requires_grad for p in u.parameters())]
        self.units = [FlatUnit(u, rank, world_size, group, stage) for u in trainable]
        if stage >= 2:
            for unit, module in zip(self.units, trainable):
                unit.install_hooks(module)
        self.optimizer = optimizer_cls([u.shard for u in self.units], **optimizer_kwargs)

    def step(self) -> None:
        """One optimizer step: (stage 1: reduce-scatter the full gradients) -> update this rank's slices ->
        (stages 1-2: all-gather the parameters; stage 3 gathers each unit when it is next used)."""
        if self.stage == 1:
            for u in self.units:
                u.reduce_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.stage < 3:
            for u in self.units:
                u.gather()

    @torch.no_grad()
    def full_parameters(self) -> list[torch.Tensor]:
        """Copies of the whole parameters in model order (stage 3 gathers each unit for it, then frees it)."""
        out = {id(p): p.detach().clone() for p in self.frozen}  # whole on every rank
        for u in self.units:
            was = u.gathered
            if not was:
                u.gather()
            out.update({id(p): p.detach().clone() for p in u.params})
            if not was:
                u.free()
        return [out[id(p)] for p in self.model.parameters()]

    def padding_is_zero(self) -> bool:
        """The padding elements of this rank's shards are still 0 (no gradient ever reaches them)."""
        # this rank's slice covers flat[r*s:(r+1)*s]; the padding is flat[n:], i.e. the slice from n - r*s on
        return all(
            bool((u.shard.detach()[max(0, u.numel - u.rank * u.shard_numel) :] == 0).all())
            for u in self.units
        )


def flat_units(model) -> list:
    """(name, module) of a ResidualMLP's flat units, each one ZeRO buffer: the stem, each residual block, the
    head."""
    blocks = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    return [("stem", model.stem), *blocks, ("head", model.head)]
