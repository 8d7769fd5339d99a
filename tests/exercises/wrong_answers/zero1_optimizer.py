"""Wrong: each rank updates its shard but never sends it: the replicas drift apart."""

from exercises.solutions.zero1_optimizer import Zero1Optimizer as _Right


class Zero1Optimizer(_Right):
    def step(self):
        self.local.step()  # the bug: no broadcast from the owner
