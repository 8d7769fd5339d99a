"""Wrong: the model, the optimizer and the data generator restored, torch's global generator not: dropout
draws other masks after the resume."""

import copy


def capture(model, optimizer, data_generator, step):
    return copy.deepcopy(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "data_rng": data_generator.get_state(),
            "step": step,
        }
    )  # the bug: no get_rng_state


def restore(state, model, optimizer, data_generator):
    state = copy.deepcopy(state)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    data_generator.set_state(state["data_rng"])
    return state["step"]
