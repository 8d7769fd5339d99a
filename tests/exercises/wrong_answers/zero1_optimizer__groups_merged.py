"""Wrong: parameter groups accepted, but flattened into one list: the first group's own lr is lost."""

from exercises.solutions.zero1_optimizer import Zero1Optimizer as _Right


class Zero1Optimizer(_Right):
    def __init__(self, params, optimizer_class, **kwargs):
        params = list(params)
        if params and isinstance(params[0], dict):
            params = [
                p for g in params for p in g["params"]
            ]  # the bug: the groups' options dropped
        super().__init__(params, optimizer_class, **kwargs)
