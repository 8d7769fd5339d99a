"""Wrong: the new token's k and v are used but never written into the cache (the next step loses them)."""

import math

import torch
import torch.distributed as dist


def decode_step(x, wq, wk, wv, wo, cache_k, cache_v, pos):
    B, heads, hd = x.shape[0], cache_k.shape[1], cache_k.shape[3]
    q, k, v = ((x @ w.T).view(B, heads, 1, hd) for w in (wq, wk, wv))
    keys = torch.cat([cache_k[:, :, :pos], k], 2)  # the bug: the cache itself is left as it was
    values = torch.cat([cache_v[:, :, :pos], v], 2)
    y = ((q @ keys.transpose(-2, -1) / math.sqrt(hd)).softmax(-1) @ values).reshape(B, heads * hd)
    out = y @ wo.T
    dist.all_reduce(out)
    return out
