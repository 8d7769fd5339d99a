"""Wrong: float16 whatever dtype was asked for (bfloat16 too)."""

import torch
import torch.distributed as dist


def compress_hook(dtype):
    def hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.half().div_(group.size())
        fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()
        return fut.then(lambda fut: buffer.copy_(fut.value()[0]))

    return hook
