"""Wrong: the float32 buffer itself all-reduced (averaged right, nothing compressed)."""

import torch
import torch.distributed as dist


def compress_hook(dtype):
    def hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer().div_(group.size())
        fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
        return fut.then(lambda fut: fut.value()[0])

    return hook
