"""Wrong: each rank returns its heads' share of the output; the all-reduce is missing."""

import math


def decode_step(x, wq, wk, wv, wo, cache_k, cache_v, pos):
    B, heads, hd = x.shape[0], cache_k.shape[1], cache_k.shape[3]
    q, k, v = ((x @ w.T).view(B, heads, 1, hd) for w in (wq, wk, wv))
    cache_k[:, :, pos : pos + 1] = k
    cache_v[:, :, pos : pos + 1] = v
    scores = q @ cache_k[:, :, : pos + 1].transpose(-2, -1) / math.sqrt(hd)
    y = (scores.softmax(-1) @ cache_v[:, :, : pos + 1]).reshape(B, heads * hd)
    return y @ wo.T  # the bug: a partial sum, never all-reduced
