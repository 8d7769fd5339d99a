"""Wrong: params read as tensors only: parameter-group dicts, which torch.optim takes, raise AttributeError
('dict' object has no attribute 'requires_grad')."""

from exercises.solutions.zero1_optimizer import Zero1Optimizer as _Right


class Zero1Optimizer(_Right):
    def __init__(self, params, optimizer_class, **kwargs):
        params = [p for p in params if p.requires_grad]  # the bug: a dict has no requires_grad
        super().__init__(params, optimizer_class, **kwargs)
