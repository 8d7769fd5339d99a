"""Grader of exercises/zero1_optimizer.py: 3 ranks, AdamW and SGD with momentum, against the unsharded
optimizer; the state each rank holds is counted."""
from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import nn

from common.differences import nan_max
from exercises.graders._common import max_abs_diff, rank_failures

WORLD_SIZE = 3  # 3, not 2: a split hard-coded for 2 ranks shows
FUNCTIONS = ["Zero1Optimizer"]
STEPS = 3
OPTIMIZERS = {"AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
              "SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    model[2].requires_grad_(False)  # a frozen layer, as in fine-tuning
    return model


def set_grads(model: nn.Module, step: int) -> None:
    """The same 'averaged' gradient on every rank (as after DDP): a loss on a fixed batch."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(10, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (10,), generator=g)
    for p in model.parameters():
        p.grad = None
    nn.functional.cross_entropy(model(x), y).backward()


def run(optimizer_factory) -> tuple[nn.Module, object]:
    model = make_model()
    opt = optimizer_factory(model)
    for step in range(STEPS):
        set_grads(model, step)
        opt.step()
        opt.zero_grad()
    return model, opt


def state_elements(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() for s in optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)


def optimizers_of(obj) -> list[torch.optim.Optimizer]:
    """Every torch.optim.Optimizer the object holds in an attribute (or a list, tuple or dict of them)."""
    found = []
    for value in vars(obj).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
            else [value]
        found += [v for v in items if isinstance(v, torch.optim.Optimizer) and all(v is not f for f in found)]
    return found


def held_state_elements(obj) -> int:
    """The optimizer-state elements this rank holds over all its optimizers (a tensor shared by two counts
    once)."""
    seen, total = set(), 0
    for optimizer in optimizers_of(obj):
        for s in optimizer.state.values():
            for v in s.values():
                if torch.is_tensor(v) and v.dim() > 0 and v.data_ptr() not in seen:
                    seen.add(v.data_ptr())
                    total += v.numel()
    return total


def on_rank(module: str) -> dict:
    zero_class = importlib.import_module(module).Zero1Optimizer
    out = {}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        model, opt = run(lambda m: zero_class(m.parameters(), cls, **kwargs))
        local = getattr(opt, "local", None)
        out[name] = {"params": [p.detach().tolist() for p in model.parameters()],
                     "state": held_state_elements(opt) if isinstance(local, torch.optim.Optimizer) else None,
                     "local_params": sum(len(g["params"]) for g in getattr(local, "param_groups", []))}
    return out


def judge(answers: list) -> list[str]:
    problems = rank_failures(answers)
    if problems:
        return problems
    frozen = [p.detach() for p in make_model()[2].parameters()]
    for name, (cls, kwargs) in OPTIMIZERS.items():
        want_model, want_opt = run(lambda m: cls(m.parameters(), **kwargs))
        want = [p.detach() for p in want_model.parameters()]
        full_state = state_elements(want_opt)
        states = []
        for rank, a in enumerate(answers):
            got = a[name]
            diff = nan_max(max_abs_diff(g, w) for g, w in zip(got["params"], want))
            if not diff <= 1e-10:
                frozen_moved = any(not max_abs_diff(g, f) == 0.0 for g, f in zip(got["params"][2:4], frozen))
                hint = ("the frozen layer (requires_grad=False) changed: skip it" if frozen_moved else
                        "after the local step, broadcast each parameter from the rank that owns it")
                return [f"{name}: rank {rank}'s parameters differ from the unsharded {name} by {diff:.2e}: "
                        f"{hint}"]
            states.append(got["state"])
        if any(s is None for s in states):
            return [f"{name}: keep the optimizer this rank steps in self.local (a torch.optim.Optimizer)"]
        if sum(states) != full_state or max(states) >= full_state:
            return [f"{name}: the ranks hold {states} optimizer-state elements (over every optimizer the "
                    f"object keeps), the unsharded optimizer {full_state}: each rank must hold state for its "
                    f"own parameters only, split over dist.get_world_size() ranks ({len(answers)} here), "
                    f"not a fixed number"]
        local_params = [a[name]["local_params"] for a in answers]
        trainable = sum(p.requires_grad for p in want_model.parameters())
        if sum(local_params) != trainable:
            return [f"{name}: the ranks' self.local optimizers hold {local_params} parameters, {trainable} "
                    f"are trainable: build self.local over this rank's shard only (an optimizer over every "
                    f"parameter, stepped after deleting the others' .grad, destroys gradients the caller "
                    f"may still read)"]
        if min(states) == 0:
            return [f"{name}: the ranks hold {states} optimizer-state elements: rank {states.index(0)} holds "
                    f"no shard; split the parameters over dist.get_world_size() ranks ({len(answers)} here), "
                    f"not a fixed number"]
    return []
