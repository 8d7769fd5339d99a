"""Wrong: the average hard-coded as x 0.5: right only with 2 ranks."""

from exercises.solutions.ddp_by_hand import DataParallelByHand as _Ref


class DataParallelByHand(_Ref):
    def finish_gradient_sync(self):
        for work, flat, params in self.pending:
            work.wait()
            flat *= 0.5  # hard-coded 2 GPUs
            off = 0
            for q in params:
                q.grad.copy_(flat[off : off + q.numel()].view_as(q.grad))
                off += q.numel()
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
