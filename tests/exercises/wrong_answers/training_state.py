"""Wrong: the state_dicts are returned as they are, so they change while training goes on."""

import torch


def capture(model, optimizer, data_generator, step):
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "data_rng": data_generator.get_state(),
        "torch_rng": torch.get_rng_state(),
        "step": step,
    }


def restore(state, model, optimizer, data_generator):
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    data_generator.set_state(state["data_rng"])
    torch.set_rng_state(state["torch_rng"])
    return state["step"]
