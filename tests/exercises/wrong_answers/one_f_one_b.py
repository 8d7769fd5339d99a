"""Wrong: GPipe's order (every forward, then every backward): right set, too many activations held."""


def one_f_one_b_order(num_microbatches, pp_size, pp_rank):
    return [("F", i) for i in range(num_microbatches)] + [("B", i) for i in range(num_microbatches)]
