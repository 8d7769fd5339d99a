"""Exercise (lesson 02): the ring all-reduce, from isend/irecv.

Fill in `ring_all_reduce`, then grade it:  python -m exercises ring_allreduce
(4 gloo processes run your function; the grader compares each rank's tensor with dist.all_reduce's).
"""
import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> None:
    """Sum `tensor` over every rank of the default process group, in place, as `dist.all_reduce(tensor)` does,
    using only point-to-point messages on a ring (rank r sends to r + 1 and receives from r - 1, mod n).

    Contract:
        tensor: a 1-D float tensor, the same length L on every rank (L need not divide by the world size n;
                L may even be smaller than n). Afterwards every rank holds the element-wise sum.
        Do not call dist.all_reduce (or any other collective): that is what you are building.

    Hint: split the tensor into n chunks with `torch.tensor_split(tensor, n)` (views: writing into them writes
    into `tensor`). Phase 1, reduce-scatter, n - 1 steps: at step s rank r sends chunk (r - s) mod n and
    receives chunk (r - s - 1) mod n, which it ADDS into its own. Phase 2, all-gather, n - 1 steps: at step s
    rank r sends chunk (r + 1 - s) mod n and receives chunk (r - s) mod n, which it COPIES over its own.
    Post each step's send and receive together (`dist.batch_isend_irecv` with two `dist.P2POp`s) and wait
    for both, so that no rank blocks in a send while its neighbour blocks in a send too.
    """
    raise NotImplementedError("ring_all_reduce")
