"""Grader of exercises/zero1_optimizer.py: 3 ranks, AdamW and SGD with momentum, against the unsharded
optimizer; the state each rank holds is counted. Also: parameter groups (as torch.optim takes them), and a
model of 2 parameters on 3 ranks (a rank may own none).

Either layout of the shards passes: whole parameters, each owned by one rank (torch's
ZeroRedundancyOptimizer), or flat buffers cut into N equal slices with up to N - 1 elements of padding each
(the ZeRO paper's, lesson 13's common/sharding/zero.py): the ranks' state may exceed the unsharded optimizer's by that
padding, no more."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import nn

from common.measure.differences import nan_max
from exercises._ranks import describe
from exercises.graders._common import answer_diff, rank_failures, unwaited, works_watched

WORLD_SIZE = 3  # 3, not 2: a split hard-coded for 2 ranks shows
FUNCTIONS = ["Zero1Optimizer"]
STEPS = 3
OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}
# case -> (optimizer, model, how the parameters are passed); the main model first, the rank-owns-nothing last
CASES = {
    "AdamW": ("AdamW", "frozen", "parameters"),
    "SGD": ("SGD", "frozen", "parameters"),
    "AdamW with parameter groups": ("AdamW", "frozen", "groups"),
    "SGD, 2 parameters on 3 ranks": ("SGD", "small", "parameters"),
}


def make_model(kind: str = "frozen") -> nn.Module:
    torch.manual_seed(0)
    if kind == "small":
        return nn.Sequential(
            nn.Linear(6, 3)
        ).double()  # a weight and a bias: one rank may own neither
    model = nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    ).double()
    model[2].requires_grad_(False)  # a frozen layer, as in fine-tuning
    return model


def params_of(model: nn.Module, how: str):
    """model.parameters(), or two parameter groups: the first layer with its own lr, the rest (the frozen
    layer included, as a user writes it) with the default."""
    if how == "parameters":
        return model.parameters()
    return [
        {"params": list(model[0].parameters()), "lr": 0.05},
        {"params": [*model[2].parameters(), *model[4].parameters()]},
    ]


def set_grads(model: nn.Module, step: int) -> None:
    """The same 'averaged' gradient on every rank (as after DDP): a loss on a fixed batch."""
    g = torch.Generator().manual_seed(step)
    x, y = (
        torch.randn(10, 6, generator=g, dtype=torch.float64),
        torch.randint(0, 3, (10,), generator=g),
    )
    for p in model.parameters():
        p.grad = None
    nn.functional.cross_entropy(model(x), y).backward()


def train(model: nn.Module, opt) -> nn.Module:
    for step in range(STEPS):
        set_grads(model, step)
        opt.step()
        opt.zero_grad()
    return model


def state_elements(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        v.numel()
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )


def optimizers_of(obj) -> list[torch.optim.Optimizer]:
    """Every torch.optim.Optimizer the object holds in an attribute (or a list, tuple or dict of them)."""
    found = []
    for value in vars(obj).values():
        items = (
            value.values()
            if isinstance(value, dict)
            else value
            if isinstance(value, (list, tuple))
            else [value]
        )
        found += [
            v
            for v in items
            if isinstance(v, torch.optim.Optimizer) and all(v is not f for f in found)
        ]
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


def _case(zero_class, learner, name: str) -> dict:
    optimizer, kind, how = CASES[name]
    cls, kwargs = OPTIMIZERS[optimizer]
    model = make_model(kind)
    try:
        opt = zero_class(params_of(model, how), cls, **kwargs)
        failed = None
    except (
        Exception
    ) as e:  # e.g. on one rank only: tell the others, so that no rank waits in a broadcast
        opt, failed = None, describe(e)
    flag = torch.tensor([0.0 if failed else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if not flag.item():
        return {"error": str(failed) if failed else None}
    log: list = []
    with works_watched(log, [learner]):
        train(model, opt)
    local = getattr(opt, "local", None)
    local_elements = sum(p.numel() for g in getattr(local, "param_groups", []) for p in g["params"])
    return {
        "params": [p.detach().tolist() for p in model.parameters()],
        "state": held_state_elements(opt) if isinstance(local, torch.optim.Optimizer) else None,
        "local_elements": local_elements,
        "unwaited": unwaited(log),
    }


def on_rank(module: str) -> dict:
    learner = importlib.import_module(module)
    return {name: _case(learner.Zero1Optimizer, learner, name) for name in CASES}


def _padding(model: nn.Module, world: int) -> int:
    """The most padding elements a correct answer may add: N - 1 per trainable parameter (one flat buffer
    per parameter is the finest cut)."""
    return (world - 1) * sum(p.requires_grad for p in model.parameters())


def _raised(name: str, answers: list) -> str | None:
    """The first rank's exception in case `name`, said for the case."""
    _, kind, how = CASES[name]
    errors = [(r, a[name]["error"]) for r, a in enumerate(answers) if a[name].get("error")]
    if not errors:
        return None
    rank, error = errors[0]
    hint = (
        "params may be parameter groups, dicts like {'params': [...], 'lr': 0.05}, as torch.optim takes "
        "them: shard each group's parameters and keep its options"
        if how == "groups"
        else "with 2 parameters on 3 ranks a rank may own none; torch.optim refuses an empty list but "
        "takes an empty group, [{'params': []}]"
        if kind == "small"
        else "the constructor must work on every rank"
    )
    return f"{name}: rank {rank} raised {error}: {hint}"


def _problem(name: str, answers: list) -> str | None:
    """The first thing wrong with the ranks' answers in case `name`, or None."""
    optimizer, kind, how = CASES[name]
    cls, kwargs = OPTIMIZERS[optimizer]
    raised = _raised(name, answers)
    if raised:
        return raised
    got = [a[name] for a in answers]
    for rank, g in enumerate(got):
        if g["unwaited"]:
            return (
                f"{name}: rank {rank} never waited on {len(g['unwaited'])} async {g['unwaited'][0]}(s): "
                f"a work handle from async_op=True must be waited on (work.wait()) before step() "
                f"returns, or the parameters may be read before the message arrived"
            )
    model = make_model(kind)
    want_opt = cls(params_of(model, how), **kwargs)
    want = [p.detach() for p in train(model, want_opt).parameters()]
    return _params_problem(name, got, want) or _state_problem(name, got, model, want_opt)


def _params_problem(name: str, got: list, want: list) -> str | None:
    """The first rank whose parameters differ from the unsharded optimizer's after training, with a hint."""
    optimizer, kind, how = CASES[name]
    frozen = [p.detach() for p in make_model()[2].parameters()] if kind == "frozen" else []
    for rank, g in enumerate(got):
        diff = nan_max(answer_diff(a, w) for a, w in zip(g["params"], want))
        if not diff <= 1e-10:
            frozen_moved = any(
                not answer_diff(a, f) == 0.0 for a, f in zip(g["params"][2:4], frozen)
            )
            hint = (
                "the frozen layer (requires_grad=False) changed: skip it"
                if frozen_moved
                else "keep each parameter group's options (its lr) for its own parameters"
                if how == "groups"
                else "after the local step, broadcast each parameter from the rank that owns it"
            )
            return (
                f"{name}: rank {rank}'s parameters differ from the unsharded {optimizer} by {diff:.2e}: "
                f"{hint}"
            )
    return None


def _state_problem(name: str, got: list, model, want_opt) -> str | None:
    """What is wrong with the optimizer state the ranks hold: none, all of it on a rank, some of it twice,
    a local optimizer over every parameter, or a rank without a shard."""
    kind, world = CASES[name][1], len(got)
    states = [g["state"] for g in got]
    if any(s is None for s in states):
        return f"{name}: keep the optimizer this rank steps in self.local (a torch.optim.Optimizer)"
    full_state = state_elements(want_opt)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    padding = _padding(model, world) * (
        full_state // trainable
    )  # per element: 2 (Adam), 1 (momentum)
    if max(states) >= full_state:
        return (
            f"{name}: the ranks hold {states} optimizer-state elements (over every optimizer the object "
            f"keeps), the unsharded optimizer {full_state}: a rank holds state for every parameter; each "
            f"rank must hold state for its own shard only"
        )
    if sum(states) > full_state + padding:
        return (
            f"{name}: the ranks hold {states} optimizer-state elements, {sum(states)} together, the "
            f"unsharded optimizer {full_state} (padding may add at most {padding}): some parameters' "
            f"state is on two ranks; split over dist.get_world_size() ranks ({world} here), not a "
            f"fixed number"
        )
    local = [g["local_elements"] for g in got]
    if sum(local) > trainable + _padding(model, world):
        return (
            f"{name}: the ranks' self.local optimizers hold {local} parameter elements, {trainable} are "
            f"trainable: build self.local over this rank's shard only (an optimizer over every "
            f"parameter, stepped after deleting the others' .grad, destroys gradients the caller may "
            f"still read)"
        )
    if kind == "frozen" and min(states) == 0:
        return (
            f"{name}: the ranks hold {states} optimizer-state elements: rank {states.index(0)} holds no "
            f"shard; split the parameters over dist.get_world_size() ranks ({world} here), not a "
            f"fixed number"
        )
    return None


def judge(answers: list) -> list[str]:
    problems = rank_failures(answers)
    if problems:
        return problems
    for name in CASES:
        problem = _problem(name, answers)
        if problem:
            return [problem]
    return []
