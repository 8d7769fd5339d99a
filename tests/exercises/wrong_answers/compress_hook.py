"""Wrong: the 16-bit buffer is all-reduced first and divided after: the sum can overflow float16."""

import torch
import torch.distributed as dist


def compress_hook(dtype):
    def hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype)
        fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(fut):
            buffer.copy_(fut.value()[0].div_(group.size()))
            return buffer

        return fut.then(decompress)

    return hook
