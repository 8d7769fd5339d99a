"""Reference solution of exercises/tp_decode_step.py (lesson 22)."""

import math

import torch
import torch.distributed as dist


def decode_step(x, wq, wk, wv, wo, cache_k, cache_v, pos: int) -> torch.Tensor:
    B, heads, hd = x.shape[0], cache_k.shape[1], cache_k.shape[3]
    q, k, v = ((x @ w.T).view(B, heads, 1, hd) for w in (wq, wk, wv))  # (B, nh/tp, 1, hd)
    cache_k[:, :, pos : pos + 1] = k  # this token's keys and values, my heads only
    cache_v[:, :, pos : pos + 1] = v
    keys, values = cache_k[:, :, : pos + 1], cache_v[:, :, : pos + 1]  # positions 0 .. pos
    scores = q @ keys.transpose(-2, -1) / math.sqrt(hd)  # (B, nh/tp, 1, pos + 1)
    y = (scores.softmax(-1) @ values).reshape(B, heads * hd)  # my heads, side by side
    partial = y @ wo.T  # (B, d): my heads' share of the output
    dist.all_reduce(partial)  # the shares of every rank's heads sum to the whole
    return partial
