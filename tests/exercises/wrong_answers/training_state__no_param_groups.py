"""Wrong: restores the optimizer's state (moments) but not its param_groups: a scheduled lr is lost."""

import copy

import torch


def capture(model, optimizer, gen, step):
    return copy.deepcopy(
        {
            "model": model.state_dict(),
            "opt_state": optimizer.state_dict()["state"],
            "data_rng": gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "step": step,
        }
    )


def restore(state, model, optimizer, gen):
    # restores moments but never the param_groups (lr, weight_decay, a scheduler's changes)
    model.load_state_dict(state["model"])
    sd = optimizer.state_dict()
    sd["state"] = state["opt_state"]
    optimizer.load_state_dict(sd)
    gen.set_state(state["data_rng"])
    torch.set_rng_state(state["torch_rng"])
    return state["step"]
