"""Exercise (lesson 22): one decode step of tensor-parallel attention, heads split over the ranks, with the
KV cache update and the all-reduce.

Fill in `decode_step`, then grade it:  python -m exercises tp_decode_step
(2 gloo processes; each rank's cache and the output are compared with unsplit attention in one process.)
"""

import torch
import torch.distributed as dist


def decode_step(x, wq, wk, wv, wo, cache_k, cache_v, pos: int) -> torch.Tensor:
    """The attention output for ONE new token, this rank holding heads [r*nh/tp, (r+1)*nh/tp).

    Contract:
        x: (B, d), the new token's hidden state, the same on every rank.
        wq, wk, wv: (d/tp, d), this rank's rows of the q, k and v projections (its heads, hd rows each);
        wo: (d, d/tp), this rank's columns of the output projection. No biases.
        cache_k, cache_v: (B, nh/tp, max_len, hd), this rank's heads' keys and values of positions
            0 .. pos-1 (the slots from pos on are empty). Write this token's k and v at position `pos`
            (in place; nothing else in the cache may change).
        Returns (B, d): softmax(q k^T / sqrt(hd)) v over positions 0 .. pos of every head, through the
        whole output projection: the same on every rank.

    Hint: the heads are independent: attend with yours, project with your columns of wo, then sum the
    ranks' partial outputs (torch.distributed, the default group). hd = d / nh = wq.shape[0] / cache heads.
    """
    raise NotImplementedError("decode_step")
