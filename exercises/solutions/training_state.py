"""Reference solution of exercises/training_state.py (lesson 16)."""

import copy

import torch
from torch import nn


def capture(
    model: nn.Module, optimizer: torch.optim.Optimizer, data_generator: torch.Generator, step: int
) -> dict:
    return copy.deepcopy(
        {  # state_dict() tensors are the live ones: an in-place update would change them
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "data_rng": data_generator.get_state(),
            "torch_rng": torch.get_rng_state(),  # dropout draws from torch's global generator
            "step": step,
        }
    )


def restore(
    state: dict, model: nn.Module, optimizer: torch.optim.Optimizer, data_generator: torch.Generator
) -> int:
    # load_state_dict keeps the optimizer's tensors: do not let the live run share them with `state`
    state = copy.deepcopy(state)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    data_generator.set_state(state["data_rng"])
    torch.set_rng_state(state["torch_rng"])
    return state["step"]
