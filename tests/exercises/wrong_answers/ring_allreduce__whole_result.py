"""Wrong: the reduce-scatter returns the whole tensor (every chunk, most of them partial sums), not rank r's
chunk."""

from exercises.solutions.ring_allreduce import _reduce_scatter_in_place, ring_all_reduce  # noqa: F401


def ring_reduce_scatter(tensor):
    t = tensor.clone()
    _reduce_scatter_in_place(t)
    return t  # the bug: not torch.tensor_split(t, n)[rank]
