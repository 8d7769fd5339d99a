"""Reference solution of exercises/ddp_by_hand.py (lesson 03)."""

import torch
import torch.distributed as dist
from torch import nn


class DataParallelByHand(nn.Module):
    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None):
        super().__init__()
        trainable = [p for p in module.parameters() if p.requires_grad]  # tied: listed once
        if (
            not trainable
        ):  # as torch's DDP: nothing to average, and a frozen model is likely a mistake
            raise RuntimeError(
                "DataParallelByHand is not needed when a module doesn't have any parameter "
                "that requires a gradient"
            )
        self.module = module
        with (
            torch.no_grad()
        ):  # every replica starts from rank 0's weights and buffers, frozen ones included
            for tensor in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(tensor, src=0)
        self.buckets = self._buckets(list(reversed(trainable)), bucket_cap_mb)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)
        self.pending = []  # (work, flat tensor, parameters of the bucket)
        for p in trainable:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    @staticmethod
    def _buckets(params: list, cap_mb: float | None) -> list[list[nn.Parameter]]:
        if cap_mb is None:
            return [[p] for p in params]  # one all-reduce per gradient
        buckets, current, size = [], [], 0
        for p in params:
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= cap_mb * 2**20:  # the bucket is full: close it
                buckets.append(current)
                current, size = [], 0
        return buckets + ([current] if current else [])

    def _grad_ready(self, p: nn.Parameter) -> None:
        i = self.bucket_of[p]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):  # the bucket's last gradient arrived: send it now
            flat = torch.cat([q.grad.flatten() for q in self.buckets[i]])
            self.pending.append((dist.all_reduce(flat, async_op=True), flat, self.buckets[i]))

    def forward(self, *args):
        return self.module(*args)

    def finish_gradient_sync(self) -> None:
        world = dist.get_world_size()
        for work, flat, params in self.pending:
            work.wait()
            flat /= world  # the sum over ranks -> the average
            offset = 0
            for q in params:
                q.grad.copy_(flat[offset : offset + q.numel()].view_as(q.grad))
                offset += q.numel()
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
