"""Grader of exercises/training_state.py: interrupt a 6-step run after 3 steps, train on, resume a fresh
copy."""

from __future__ import annotations

import importlib
import io

import torch
from torch import nn

WORLD_SIZE = 0
FUNCTIONS = ["capture", "restore"]
STEPS, STOP = 6, 3
X = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(2))


def fresh(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optimizer, torch.Generator().manual_seed(7)


def train_step(model, optimizer, generator) -> float:
    batch = torch.randperm(64, generator=generator)[
        :16
    ]  # the data order draws from its own generator
    loss = nn.functional.cross_entropy(
        model(X[batch]), Y[batch]
    )  # dropout draws from torch's global one
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    for (
        group
    ) in optimizer.param_groups:  # a learning-rate schedule (as a scheduler's step() does): the lr
        group["lr"] *= 0.7  # at capture is not the one a fresh optimizer starts with
    return loss.item()


def check(module: str) -> list[str]:
    mod = importlib.import_module(module)
    model, optimizer, gen = fresh()
    losses = [train_step(model, optimizer, gen) for _ in range(STOP)]
    state = mod.capture(model, optimizer, gen, STOP)
    lr_at_capture = [group["lr"] for group in optimizer.param_groups]
    buffer = io.BytesIO()
    torch.save(state, buffer)  # the state must be something a checkpoint can hold
    losses += [
        train_step(model, optimizer, gen) for _ in range(STOP, STEPS)
    ]  # the run goes on after capture
    final = {k: v.clone() for k, v in model.state_dict().items()}

    model2, optimizer2, gen2 = fresh(
        seed=123
    )  # a different init: only what you restored may matter
    torch.manual_seed(999)  # and a different global RNG state
    start = mod.restore(state, model2, optimizer2, gen2)
    if start != STOP:
        return [f"restore returned step {start}, expected {STOP}"]
    lr_restored = [group["lr"] for group in optimizer2.param_groups]
    if lr_restored != lr_at_capture:
        return [
            f"after restore the optimizer's lr is {lr_restored[0]:.6g}, at capture it was "
            f"{lr_at_capture[0]:.6g} (a schedule changed it): capture and restore the optimizer's whole "
            f"state_dict: its param_groups hold the lr, its state AdamW's moments"
        ]
    resumed = [train_step(model2, optimizer2, gen2) for _ in range(STOP, STEPS)]
    if resumed != losses[STOP:]:
        return [
            f"resumed losses {[f'{v:.6f}' for v in resumed]} differ from the uninterrupted run's "
            f"{[f'{v:.6f}' for v in losses[STOP:]]}: {_diagnose(mod, state)}"
        ]
    for name, value in model2.state_dict().items():
        if not torch.equal(value, final[name]):
            return [f"after resuming, parameter {name} differs from the uninterrupted run's"]
    return []


def _diagnose(mod, state) -> str:
    """Name the first missing piece: state that changed with the live run, or a generator not restored."""
    model, optimizer, gen = fresh()
    for _ in range(STOP):
        train_step(model, optimizer, gen)
    again = mod.capture(model, optimizer, gen, STOP)
    for _ in range(2):
        train_step(model, optimizer, gen)
    before = io.BytesIO()
    torch.save(again, before)
    rerun_model, rerun_opt, rerun_gen = fresh()
    for _ in range(STOP):
        train_step(rerun_model, rerun_opt, rerun_gen)
    clean = io.BytesIO()
    torch.save(mod.capture(rerun_model, rerun_opt, rerun_gen, STOP), clean)
    if before.getvalue() != clean.getvalue():
        return "what capture returned changed while training went on: copy the state_dicts (copy.deepcopy)"
    return (
        "check each piece: the model, the optimizer (AdamW's moments and step), the data generator's "
        "state, and torch.get_rng_state() for dropout"
    )
