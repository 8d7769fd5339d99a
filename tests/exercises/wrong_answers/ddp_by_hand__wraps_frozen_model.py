"""Wrong: a module with no trainable parameter wrapped silently (torch's DDP raises RuntimeError: there is
nothing to average, and a model frozen by mistake then trains nothing without a word)."""

from torch import nn

from exercises.solutions.ddp_by_hand import DataParallelByHand as _Right


class DataParallelByHand(_Right):
    def __init__(self, module, bucket_cap_mb=None):
        if not any(p.requires_grad for p in module.parameters()):
            nn.Module.__init__(self)  # the bug: no error
            self.module, self.buckets, self.pending = module, [], []
            return
        super().__init__(module, bucket_cap_mb)
