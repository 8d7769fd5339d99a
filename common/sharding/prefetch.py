"""FSDP2's prefetching made visible: the order of its all-gathers and the gathered parameter bytes held (14).

- `set_prefetch(model, how)`: FSDP2's implicit prefetching, explicit (`set_modules_to_forward_prefetch`,
  `set_modules_to_backward_prefetch`: the next block), or none;
- `prefetch_profile(model, x, y)`: one step's collectives in order, with markers of what computed between them,
  and the peak of gathered parameter bytes (`gathered_bytes`);
- `prefetch_runs(build, x, y)`: that profile for each of the three ways.

Models come from `common.sharding.fsdp.shard_blocks_then_root`. Source: torch/distributed/fsdp/_fully_shard/
(_fsdp_state.py, _fsdp_param_group.py).
"""

from __future__ import annotations

from itertools import zip_longest

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.measure.counters import count_collectives
from common.measure.memory import storage_bytes
from common.models import ResidualMLP
from common.sharding.fsdp import param_groups

__all__ = ["set_prefetch", "gathered_bytes", "prefetch_profile", "prefetch_runs"]


def set_prefetch(model: ResidualMLP, how: str) -> ResidualMLP:
    """Prefetching of a model from `shard_blocks_then_root`, `how` one of:

    - "implicit", FSDP2's default: in backward each unit, at its pre-backward, all-gathers the unit before it
      in forward order (the root block -1, block i block i-1). In forward, on a GPU, the next unit's
      all-gather is issued when that unit's forward begins, and overlaps the current one's compute through
      FSDP2's streams (the note on implicit forward prefetching, _fsdp_param_group.py); on a CPU with gloo
      nothing runs ahead, so each unit is gathered only when its forward begins.
    - "explicit": `set_modules_to_forward_prefetch`, each unit the next block (the root block 0, block i
      block i+1: issued from the CPU before block i computes; torch's docstring: a one-item list gives the
      default overlap, issued earlier, at the price of one block more held), and
      `set_modules_to_backward_prefetch`, each unit the block before it (the implicit order, made explicit).
    - "none": every unit's backward prefetch list is itself, already gathered then: a no-op that replaces the
      implicit prefetch (an explicit list, even one doing nothing, turns the implicit one off).
    """
    blocks = list(model.blocks)
    if how == "none":
        for unit in (model, *blocks):
            unit.set_modules_to_backward_prefetch([unit])
    elif how == "explicit":
        for unit, after in zip((model, *blocks), blocks):
            unit.set_modules_to_forward_prefetch([after])
        for unit, before in zip((model, *blocks[:0:-1]), blocks[::-1]):
            unit.set_modules_to_backward_prefetch([before])
    elif how != "implicit":
        raise ValueError(f"unknown prefetching {how!r}: implicit, explicit or none")
    return model


def gathered_bytes(model: nn.Module) -> int:
    """Bytes of gathered (unsharded) parameters the FSDP2 units of `model` hold now: a unit all-gathered ahead of
    time and not yet copied out holds its all-gather output; an unsharded unit its parameters' storage (rows
    padded to the shard group). (Not counted: the all-gather output FSDP2 keeps after a copy-out until the next
    one in forward, for the GPU's streams.)"""
    held = []
    for group in param_groups(model):
        if group._all_gather_result is not None:
            held.append(group._all_gather_result.all_gather_output)
        elif group.is_unsharded:
            held += [t for fp in group.fsdp_params for t in fp.all_gather_outputs]
    return storage_bytes(held)


def _in_flight(model: nn.Module) -> int:
    """All-gathers issued and not finished: a c10d work object not completed (None: it returned done)."""
    works = [
        g._all_gather_result.all_gather_work for g in param_groups(model) if g._all_gather_result
    ]
    return sum(1 for w in works if w is not None and not w.is_completed())


def prefetch_profile(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """One forward and backward on (x, y). Returns "log": the collectives in order as (op, bytes), with
    ("forward <name>", 0) at each Linear's forward and ("backward", 0) where backward begins; "forward_gathers":
    the all-gathers issued before block 0 computes; "backward_gathers": those in backward before the first
    reduce-scatter; at the Linears' forwards, the "peak" of `gathered_bytes` and the most all-gathers "in_flight".
    """
    seen = {"peak": 0, "in_flight": 0}
    with count_collectives() as c:

        def look(module, args, name):
            c.mark(f"forward {name}")
            seen["peak"] = max(seen["peak"], gathered_bytes(model))
            seen["in_flight"] = max(seen["in_flight"], _in_flight(model))

        hooks = [
            m.register_forward_pre_hook(lambda mod, a, name=name: look(mod, a, name))
            for name, m in model.named_modules()
            if isinstance(m, nn.Linear)
        ]
        loss = F.cross_entropy(model(x), y)
        c.mark("backward")
        loss.backward()
    for h in hooks:
        h.remove()
    log = [(op, b) for op, b in c.log]
    start = log.index(("backward", 0))
    first = next(i for i, e in enumerate(log) if e[0].startswith("forward blocks.0"))
    after = [op for op, _ in log[start:]]
    stop = after.index("reduce_scatter_single") if "reduce_scatter_single" in after else len(after)
    ags = [op == "all_gather_single" for op, _ in log]
    return {
        "log": log,
        "forward_gathers": sum(ags[:first]),
        "backward_gathers": sum(ags[start : start + stop]),
        "backward_log": log[start:],
        **seen,
    }


def prefetch_runs(build, x: torch.Tensor, y: torch.Tensor) -> dict[str, dict]:
    """`prefetch_profile` of `set_prefetch(build(), how)` (`build()`: a model from `shard_blocks_then_root`) for
    how in implicit, none, explicit; each with "unlike_implicit": the entries of its backward log unlike
    implicit's (the order of the same collectives, or other ones)."""
    ways = ("implicit", "none", "explicit")
    runs = {how: prefetch_profile(set_prefetch(build(), how), x, y) for how in ways}
    for r in runs.values():
        pairs = zip_longest(r["backward_log"], runs["implicit"]["backward_log"])
        r["unlike_implicit"] = sum(a != b for a, b in pairs)
    return runs
