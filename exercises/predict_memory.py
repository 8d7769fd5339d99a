"""Exercise (lesson 21): predict the bytes one rank holds under DDP and ZeRO stages 1, 2 and 3.

Fill in `bytes_per_rank`, then grade it:  python -m exercises predict_memory
(one process: the grader builds what a rank of ZeRO by hand really keeps, lesson 13's flat units and shards,
takes an Adam step, and counts the tensors' storage bytes, for several models, world sizes and stages).
"""

from torch import nn


def bytes_per_rank(units: list[nn.Module], world_size: int, stage: int) -> dict[str, int]:
    """Bytes rank 0 holds after one fp32 Adam step, for DDP (stage 0) or ZeRO stage 1, 2 or 3.

    Contract:
        units: the model's flat units (lesson 13: the stem, each block, the head); every parameter is in
            exactly one unit, float32, all trainable.
        Return {"parameters": ..., "gradients": ..., "optimizer_state": ...} in bytes:
        - parameters: at rest, after the step (ZeRO keeps each unit in one flat buffer of N x s elements,
          s = ceil(n / N) for a unit of n elements, the last up to N - 1 of them padding; stage 3 frees the
          flat buffer between uses and keeps only this rank's shard of s elements);
        - gradients: at the end of backward, before the step (stages 2 and 3 reduce-scatter each unit's
          gradient as soon as it is complete and keep the shard of s elements; DDP and stage 1 hold them all);
        - optimizer_state: torch.optim.Adam's state: exp_avg and exp_avg_sq (fp32, like what they update) and
          a 0-d fp32 `step` for every tensor Adam updates (DDP: each parameter; ZeRO: each unit's shard).

    Hint: start from DDP (4 + 4 + 8 bytes per parameter, + 4 per tensor), then ask, term by term, what each
    stage shards. Which stage is the first to cut the gradients?
    """
    raise NotImplementedError("bytes_per_rank")
