"""Exercise (lesson 09): the order of one 1F1B pipeline stage's forwards and backwards.

Fill in `one_f_one_b_order`, then grade it:  python -m exercises one_f_one_b
(graded in one process against lesson 09's schedule, for many stage counts, micro-batch counts and stages).
"""


def one_f_one_b_order(num_microbatches: int, pp_size: int, pp_rank: int) -> list[tuple[str, int]]:
    """What stage `pp_rank` of a `pp_size`-stage pipeline runs, in order, under 1F1B (PipeDream-Flush):
    a list of ("F", i) and ("B", i), micro-batch i in 0 .. num_microbatches - 1, each exactly once.

    Contract: a warm-up of forwards, then alternate one forward and one backward, then a cool-down of the
    backwards left. The warm-up is as short as it can be while the last stage never waits: stage k runs
    min(pp_size - 1 - k, num_microbatches) forwards before its first backward. So the last stage alternates
    from the start, and stage k never holds more than pp_size - k micro-batches' activations (GPipe holds all
    of them).

    Example, 4 micro-batches on 2 stages:
        stage 0 -> F0 F1 B0 F2 B1 F3 B2 B3
        stage 1 -> F0 B0 F1 B1 F2 B2 F3 B3
    """
    raise NotImplementedError("one_f_one_b_order")
