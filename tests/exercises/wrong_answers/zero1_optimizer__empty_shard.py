"""Wrong: parameter groups kept, but the groups this rank owns nothing of dropped: with 2 parameters on 3
ranks one rank owns none, its list of groups is empty, and torch.optim raises "optimizer got an empty
parameter list"."""

from exercises.solutions.zero1_optimizer import Zero1Optimizer as _Right


class Zero1Optimizer(_Right):
    def __init__(self, params, optimizer_class, **kwargs):
        original = optimizer_class

        def without_empty_groups(groups, **kw):
            return original(
                [g for g in groups if g["params"]], **kw
            )  # the bug: [] when a rank owns none

        super().__init__(params, without_empty_groups, **kwargs)
