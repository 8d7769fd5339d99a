"""Reference solution of exercises/one_f_one_b.py (lesson 09)."""


def one_f_one_b_order(num_microbatches: int, pp_size: int, pp_rank: int) -> list[tuple[str, int]]:
    m = num_microbatches
    warmup = min(
        pp_size - 1 - pp_rank, m
    )  # forwards in flight before the first backward reaches this stage
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]  # cool-down
    return order
