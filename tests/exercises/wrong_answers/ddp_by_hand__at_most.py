"""Wrong: a bucket closed before it would pass the cap ("at most c bytes"), not as soon as it holds at least
c bytes (the contract's rule, DDP's)."""

from exercises.solutions.ddp_by_hand import DataParallelByHand as _Right


class DataParallelByHand(_Right):
    @staticmethod
    def _buckets(params, cap_mb):
        if cap_mb is None:
            return [[p] for p in params]
        buckets, current, size = [], [], 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > cap_mb * 2**20:  # the bug: the other rule
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        return buckets + ([current] if current else [])
