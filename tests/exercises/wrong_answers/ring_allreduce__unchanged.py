"""Wrong: the all-reduce sums into a copy of the tensor, and never writes the copy back into `tensor`."""

from exercises.solutions.ring_allreduce import ring_all_reduce as _right
from exercises.solutions.ring_allreduce import ring_reduce_scatter  # noqa: F401  (the grader calls it)


def ring_all_reduce(tensor):
    _right(tensor.clone())  # the bug: the caller's tensor is left as it was
