"""Exercise (lesson 16): capture and restore the full training state, so that a resumed run equals the
uninterrupted one bit for bit.

Fill in `capture` and `restore`, then grade them:  python -m exercises training_state
(graded in one process: a run with dropout, AdamW and a shuffling generator is interrupted after 3 of 6
steps, keeps training, then a fresh model resumes from what you captured; its last 3 steps must equal the
uninterrupted run's exactly).
"""

import torch
from torch import nn


def capture(
    model: nn.Module, optimizer: torch.optim.Optimizer, data_generator: torch.Generator, step: int
) -> dict:
    """Everything the next steps depend on, as a dict that survives torch.save / torch.load.

    Contract: the run keeps training after you capture (so whatever you return must not change when the live
    model and optimizer do), and a FRESH model, optimizer and generator restored from it must continue exactly
    as the original did. `step` is the number of steps already taken.

    Hint: four kinds of state: the model's parameters, the optimizer's state (AdamW's moments and step count),
    the random number generators (the data order's `data_generator`, and torch's global one that dropout
    draws from: torch.get_rng_state()), and the step. A state_dict() holds references to the live tensors:
    copy them (copy.deepcopy, or a save to bytes).
    """
    raise NotImplementedError("capture")


def restore(
    state: dict, model: nn.Module, optimizer: torch.optim.Optimizer, data_generator: torch.Generator
) -> int:
    """Load `state` into a fresh `model`, `optimizer` and `data_generator`; return the step to continue
    from."""
    raise NotImplementedError("restore")
