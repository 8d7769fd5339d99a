"""Wrong: the right reduce-scatter, but the all-reduce passes the WHOLE tensor around the ring n - 1 times:
the right sum, (n - 1) x the tensor sent per rank instead of 2 (n - 1) / n."""

from exercises.solutions.ring_allreduce import ring_reduce_scatter  # noqa: F401
from tests.exercises.wrong_answers.ring_allreduce__whole_tensor import ring_all_reduce  # noqa: F401
