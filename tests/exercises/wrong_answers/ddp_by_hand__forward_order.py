"""Wrong: the buckets filled in the forward order of module.parameters(): the first layers' gradients,
which backward produces last, share a bucket with the last layers'."""

from exercises.solutions.ddp_by_hand import DataParallelByHand as _Right


class DataParallelByHand(_Right):
    def __init__(self, module, bucket_cap_mb=None):
        super().__init__(module, bucket_cap_mb)
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.buckets = self._buckets(trainable, bucket_cap_mb)  # the bug: not reversed
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)
