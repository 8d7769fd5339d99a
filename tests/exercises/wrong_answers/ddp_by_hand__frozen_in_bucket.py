"""Wrong: the buckets built over every parameter in reverse, the frozen ones included: the hooks sit on the
trainable ones only, so a bucket holding a frozen parameter never fills and never fires."""

from exercises.solutions.ddp_by_hand import DataParallelByHand as _Right


class DataParallelByHand(_Right):
    def __init__(self, module, bucket_cap_mb=None):
        super().__init__(module, bucket_cap_mb)
        self.buckets = self._buckets(
            list(reversed(list(module.parameters()))), bucket_cap_mb
        )  # the bug
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)
