"""PyTorch's own context parallelism, `torch.distributed.tensor.experimental.context_parallel`, tried (lesson 19).

It shards the buffers in place along their sequence dimension and swaps the attention kernel for a ring
version while the context is open; it needs a DeviceMesh and, in torch 2.13, a CUDA attention kernel (on CPU
the flash-attention operator has no sharding strategy). What happened is recorded as it is, never claimed.
Tutorial: https://pytorch.org/tutorials/prototype/context_parallel.html
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.measure.differences import max_abs_diff

__all__ = ["try_context_parallel"]


def try_context_parallel(mesh, whole: list[torch.Tensor]) -> str:
    """Causal SDPA of q, k, v `whole` (B, H, S, D) under `context_parallel` on `mesh`, unsharded, against SDPA
    on the whole sequence: "runs on DEVICE: max |unsharded - SDPA| = ...", or the error's type and first line."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    ref = F.scaled_dot_product_attention(*whole, is_causal=True)
    q, k, v = (t.clone() for t in whole)
    try:
        with context_parallel(
            mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]
        ):  # sharded in place
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (out,) = context_parallel_unshard(mesh, [out], [2])
        return f"runs on {ref.device.type}: max |unsharded - SDPA| = {max_abs_diff(out, ref):.1e}"
    except Exception as e:  # recorded as it is: the first line of the error
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
