"""A sampler's `__len__` and the steps each rank runs (lesson 04, myth 5): the blog-post counter-example.

Many blog posts write a distributed sampler that strides without padding and whose `__len__` returns the
dataset's length. Both are wrong in a way a DataLoader shows at once:

    len_vs_yield(BlogShardSampler(11, 2, 0), batch_size=2, drop_last=False)   # {"len": 6, "yielded": 3}

`len(DataLoader)` is then the dataset's batches, not this rank's, so schedules and progress bars are wrong;
and without padding the ranks hold ceil(n/W) or floor(n/W) samples, so their step counts differ exactly when
those make different numbers of batches (`blog_steps_differ`, checked against what BatchSampler yields by
`step_rule_mismatches`). Under DDP the rank with more steps then waits in an all-reduce the other never joins
(lesson 05). The samplers to use are in `common.data_parallel.samplers`.
"""

from __future__ import annotations

from itertools import product

from torch.utils.data import BatchSampler, DataLoader, Sampler

__all__ = ["BlogShardSampler", "blog_steps_differ", "len_vs_yield", "step_rule_mismatches"]


class BlogShardSampler(Sampler):
    """What many blog posts write -- the counter-example, not for use: it strides without padding (ranks hold
    ceil(n/W) or floor(n/W) samples), and __len__ returns the dataset's length, not this rank's."""

    def __init__(self, n: int, num_replicas: int, rank: int):
        self.n, self.num_replicas, self.rank = n, num_replicas, rank

    def __iter__(self):
        return iter(range(self.rank, self.n, self.num_replicas))

    def __len__(self) -> int:
        return self.n  # the bug: the dataset's length, not this rank's


def len_vs_yield(sampler: Sampler, batch_size: int, drop_last: bool) -> dict:
    """What a DataLoader over `sampler` claims (len) and what it yields, in batches."""
    loader = DataLoader(range(10**9), batch_size=batch_size, sampler=sampler, drop_last=drop_last)
    return {"len": len(loader), "yielded": sum(1 for _ in loader)}


def blog_steps_differ(n: int, world_size: int, batch_size: int, drop_last: bool) -> bool:
    """The rule: an unpadded stride sampler leaves ranks with different step counts exactly when W does not
    divide n AND ceil(n/W) and floor(n/W) samples make different numbers of batches of batch_size."""

    def batches(count: int) -> int:
        return count // batch_size if drop_last else -(-count // batch_size)

    return n % world_size != 0 and batches(-(-n // world_size)) != batches(n // world_size)


def step_rule_mismatches(max_n: int = 40) -> tuple[int, int]:
    """(configurations where the rule disagrees with the batches BatchSampler yields per rank, total):
    n = 1..max_n samples, W = 1..4 ranks, batch 1..4, with and without drop_last."""
    configs, bad = list(product(range(1, max_n + 1), range(1, 5), range(1, 5), (False, True))), 0
    for n, w, b, dl in configs:
        steps = {len(list(BatchSampler(BlogShardSampler(n, w, r), b, dl))) for r in range(w)}
        bad += (len(steps) > 1) != blog_steps_differ(n, w, b, dl)
    return bad, len(configs)
