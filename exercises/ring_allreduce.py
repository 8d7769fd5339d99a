"""Exercise (lesson 02): the ring reduce-scatter and all-reduce, from isend/irecv.

Fill in `ring_reduce_scatter` and `ring_all_reduce`, then grade them:  python -m exercises ring_allreduce
(4 gloo processes run your functions; the grader compares each rank's result with the exact sums).
"""

import torch
import torch.distributed as dist


def ring_reduce_scatter(tensor: torch.Tensor) -> torch.Tensor:
    """Rank r's chunk of the sum of `tensor` over every rank, as `dist.reduce_scatter_tensor` gives it:
    rank r receives the sum of chunk r, the chunks being `torch.tensor_split(tensor, n)` (uneven when the
    length L does not divide by n: 10 over 4 ranks is 3, 3, 2, 2), using only point-to-point messages on a
    ring (rank r sends to r + 1 and receives from r - 1, mod n).

    Contract:
        tensor: a 1-D float tensor, the same length L on every rank (L need not divide by the world size n;
                L may even be smaller than n, leaving some chunks empty). Returns a new tensor, the sum over
                ranks of chunk r (its length is that chunk's); `tensor` may be used as scratch.
        Each rank sends (n - 1) chunks, about (n - 1) / n of the tensor: never the whole tensor per step.
        Do not call any collective: that is what you are building.

    Hint: lesson 02's minimal script runs the reduce-scatter with rank r sending chunk (r - s) mod n at step
    s; after its n - 1 steps rank r holds the full sum of chunk (r + 1) mod n, not chunk r. Which chunk must
    rank r send at step 0 so that the one it completes is its own? Post each step's send and receive together
    (`dist.batch_isend_irecv` with two `dist.P2POp`s) and wait for both.
    """
    raise NotImplementedError("ring_reduce_scatter")


def ring_all_reduce(tensor: torch.Tensor) -> None:
    """Sum `tensor` over every rank, in place, as `dist.all_reduce(tensor)` does: your reduce-scatter, then
    an all-gather around the same ring (n - 1 steps in which each finished chunk travels on and is COPIED).

    Contract: as `ring_reduce_scatter`'s; afterwards every rank holds the element-wise sum. Each rank sends
    2 (n - 1) chunks, about 2 (n - 1) / n of the tensor.

    Hint: after your reduce-scatter rank r holds the finished chunk r; at step s of the all-gather it sends
    the chunk it finished or received last, and receives the one its left neighbour holds.
    """
    raise NotImplementedError("ring_all_reduce")
