"""Wrong: the new k and v are broadcast into every slot from pos on, not written at pos alone."""

import math

import torch.distributed as dist


def decode_step(x, wq, wk, wv, wo, cache_k, cache_v, pos):
    B, heads, hd = x.shape[0], cache_k.shape[1], cache_k.shape[3]
    q, k, v = ((x @ w.T).view(B, heads, 1, hd) for w in (wq, wk, wv))
    cache_k[:, :, pos:] = k  # the bug: every later slot too
    cache_v[:, :, pos:] = v
    scores = q @ cache_k[:, :, : pos + 1].transpose(-2, -1) / math.sqrt(hd)
    y = (scores.softmax(-1) @ cache_v[:, :, : pos + 1]).reshape(B, heads * hd)
    out = y @ wo.T
    dist.all_reduce(out)
    return out
