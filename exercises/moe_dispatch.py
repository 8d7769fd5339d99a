"""Exercise (lesson 20): the dispatch plan of expert parallelism -- who sends which rows to whom.

Fill in the function, then grade it:  python -m exercises moe_dispatch
(graded in one process: many routings, expert counts and ep sizes, compared with the lesson's plan).
"""

import torch


def dispatch_plan(
    expert_of: torch.Tensor, num_experts: int, ep: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What one rank passes to all_to_all_single before its experts' rows travel.

    Contract:
        expert_of: (M,) int64, the expert each of this rank's M routed rows goes to (top-1: a row per token).
        The E = num_experts experts are spread over ep ranks in contiguous blocks: rank d holds experts
        d*E/ep ... (d+1)*E/ep - 1 (E is divisible by ep).
        Returns send_counts, (ep,) int64: send_counts[d] = the rows going to rank d (0 for a rank that gets
        none: all_to_all_single needs one split size per rank), and order, (M,) int64: a permutation of
        0..M-1 such that x[order] lists the rows in the order they are sent -- rank 0's rows first, then rank
        1's, ...; within a rank sorted by expert (the receiver runs its experts on contiguous rows); rows with
        the same expert in their original order.

    Hint: sorting by expert already groups by destination rank. torch.argsort has `stable=True`;
    torch.bincount has `minlength`.
    """
    raise NotImplementedError("dispatch_plan")
