"""Wrong: the right optimizer kept under another name (self.optimizer): the contract's self.local is what
the grader (and a caller that saves its state) reads."""

from exercises.solutions.zero1_optimizer import Zero1Optimizer as _Right


class Zero1Optimizer(_Right):
    def __init__(self, params, optimizer_class, **kwargs):
        super().__init__(params, optimizer_class, **kwargs)
        self.optimizer = self.local
        del self.local

    def step(self):
        self.local = self.optimizer
        try:
            super().step()
        finally:
            del self.local
