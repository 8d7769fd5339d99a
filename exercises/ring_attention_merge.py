"""Exercise (lesson 19): merge two partial attentions into the full one (what makes ring attention exact).

Fill in `merge`, then grade it:  python -m exercises ring_attention_merge
(graded in one process: attention computed over two key blocks separately and merged by your function must
equal torch.nn.functional.scaled_dot_product_attention over all the keys.)
"""

import torch


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Combine the attention of the same queries over two disjoint blocks of keys, A and B.

    Contract:
        out_a: (B, H, Sq, D), softmax attention of the queries over block A alone: for each query,
               sum_j softmax_A(s)_j v_j, where the softmax normalises over A's keys only.
        lse_a: (B, H, Sq), the log of that softmax's denominator, log sum_{j in A} exp(s_j)
               (s_j = q . k_j / sqrt(D)); the same for out_b, lse_b over block B.
        Returns (out, lse): the attention over A and B together (what one softmax over all the keys gives)
        and its log-sum-exp. No NaN may appear for finite inputs, whatever the sizes of the lse values
        (they can be large: do not exponentiate them alone).

    Hint: the full denominator is exp(lse_a) + exp(lse_b); each block's output was divided by its own part
    of it. torch.logaddexp computes log(exp(x) + exp(y)) without overflow.
    """
    raise NotImplementedError("merge")
