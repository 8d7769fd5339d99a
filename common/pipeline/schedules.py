"""Pipeline schedules as pure functions: cutting a model into stages, micro-batches, the order of each stage's
work under GPipe, 1F1B and interleaved 1F1B, and the bubble theory predicts (lesson 09).

A model that is an `nn.Sequential` is cut at module indices into stages; with one stage per rank, stage k lives
on pp_rank k (names as in picotron: pp_rank, pp_world_size, pp_is_first_stage, pp_is_last_stage). A batch of N
samples is cut into m micro-batches. A schedule is, for each pp_rank, a list of actions: ('F', i) is the forward
of micro-batch i, ('B', i) its backward. Names follow `torch.distributed.pipelining`
(https://pytorch.org/docs/stable/distributed.pipelining.html): ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B.

    gpipe           F0 F1 .. F(m-1) B0 B1 .. B(m-1)      every stage holds the activations of m micro-batches
                                                         (without the paper's recomputation, as ScheduleGPipe)
    1f1b            (p-1-pp_rank) warm-up forwards, then one forward and one backward in turn, then the
                    remaining backwards                  stage pp_rank holds at most p - pp_rank micro-batches
    interleaved     v stages per rank (rank r holds stages r, r+p, ..., r+(v-1)p); 1F1B over the v*m actions

GPipe: Huang et al. 2019 (https://arxiv.org/abs/1811.06965). 1F1B with a flush at the end of every step is
PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training",
https://arxiv.org/abs/2006.09503), not the asynchronous PipeDream of 2018 (which keeps several weight versions
and never flushes). Interleaved 1F1B: Narayanan et al. 2021, Megatron-LM (https://arxiv.org/abs/2104.04473).

With p equal stages GPipe and 1F1B leave the same idle fraction, the bubble (p-1)/(m+p-1); 1F1B only lowers
memory. Interleaving v stages per rank shrinks it to (p-1)/(v*m+p-1), at the cost of v times the messages.
Zero-bubble schedules (Qi et al. 2023, https://arxiv.org/abs/2401.10241; torch 2.13's
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble) split each backward into the input gradient, which the
previous stage waits for, and the weight gradient, which can wait, and fill the bubble with the latter.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch.nn as nn

__all__ = [
    "split_model",
    "default_split_points",
    "plan_stages",
    "microbatch_sizes",
    "gpipe_order",
    "one_f_one_b_order",
    "interleaved_stage_indices",
    "interleaved_1f1b_order",
    "schedule_order",
    "schedule_limit",
    "peak_live_in_order",
    "theory_bubble",
    "theory_speedup",
]


# ----------------------------------------------------------------------------------------------- splitting
def split_model(model: nn.Sequential, split_points: Sequence[int]) -> list[nn.Sequential]:
    """Cut `model` before each module index in `split_points`: [2, 4] on 6 modules -> [0:2], [2:4], [4:6].

    The stages share the model's parameters (no copy), so `sum(stage params) == model params`.

    Raises:
        ValueError: a split point outside 1 .. len(model)-1 (a stage would be empty), or points not increasing.
    """
    n = len(model)
    pts = list(split_points)
    for s in pts:
        if not 0 < s < n:
            raise ValueError(
                f"split point {s} is outside the model: a {n}-module model can be cut at 1..{n - 1}"
            )
    if any(b <= a for a, b in zip(pts, pts[1:])):
        raise ValueError(f"split points must be strictly increasing, got {pts}")
    bounds = [0, *pts, n]
    return [model[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def default_split_points(model: nn.Sequential, num_stages: int) -> list[int]:
    """Cut points that give each of `num_stages` stages about the same number of Linear layers.

    A stage starts at a Linear (never between a Linear and its activation). Example: 5 Linears, 2 stages ->
    the 3rd Linear starts stage 1. Raises ValueError if there are fewer Linear layers than stages.
    """
    starts = [i for i, mod in enumerate(model) if isinstance(mod, nn.Linear)]
    if len(starts) < num_stages:
        raise ValueError(f"{len(starts)} Linear layers cannot fill {num_stages} stages")
    return [starts[round(k * len(starts) / num_stages)] for k in range(1, num_stages)]


def plan_stages(
    model: nn.Sequential,
    world_size: int,
    num_stages: int | None = None,
    split_points: Sequence[int] | None = None,
) -> tuple[int, list[int]]:
    """(stages, split points) of a pipeline with one stage per rank: `split_points` if given, else
    `default_split_points`; the stages default to one more than the points given, or the world size.

    Raises:
        ValueError: the stages are not one per rank, the points do not make that many stages, or a point is
        outside the model (`split_model`).
    """
    stages = num_stages or (len(split_points) + 1 if split_points else world_size)
    if stages != world_size:
        raise ValueError(
            f"{stages} pipeline stages need {stages} processes (one stage per rank), but the world "
            f"size is {world_size}"
        )
    points = list(split_points or default_split_points(model, stages))
    if len(split_model(model, points)) != stages:
        raise ValueError(f"split points {points} make {len(points) + 1} stages, not {stages}")
    return stages, points


def microbatch_sizes(batch_size: int, num_microbatches: int) -> list[int]:
    """Sizes of the m micro-batches of a batch, as `torch.chunk` cuts it: ceil(N/m) each, the rest last.

    10 into 4 -> [3, 3, 3, 1]; 8 into 4 -> [2, 2, 2, 2]. (`torch.distributed.pipelining` uses `tensor_split`
    instead, 10 into 4 -> [3, 3, 2, 2], and in torch 2.13 fails on unequal micro-batches; see lesson 09.)

    Raises:
        ValueError: m < 1, m > N (an empty micro-batch), or ceil(N/m)-sized chunks do not make m micro-batches
        (10 into 6 would give 5).
    """
    if num_microbatches < 1:
        raise ValueError(f"the number of micro-batches must be >= 1, got {num_microbatches}")
    if num_microbatches > batch_size:
        raise ValueError(
            f"{num_microbatches} micro-batches need at least {num_microbatches} samples, "
            f"the batch has {batch_size}"
        )
    c = math.ceil(batch_size / num_microbatches)
    sizes = [min(c, batch_size - i * c) for i in range(num_microbatches)]
    if min(sizes) < 1:
        raise ValueError(
            f"a batch of {batch_size} cut in chunks of {c} makes fewer than {num_microbatches} "
            f"micro-batches; choose m dividing the batch more evenly"
        )
    return sizes


# ----------------------------------------------------------------------------------------------- schedules
def gpipe_order(num_microbatches: int) -> list[tuple[str, int]]:
    """GPipe on any stage: all forwards, then all backwards: [('F',0),..,('F',m-1),('B',0),..,('B',m-1)]."""
    m = num_microbatches
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_order(
    num_microbatches: int, pp_world_size: int, pp_rank: int
) -> list[tuple[str, int]]:
    """1F1B (PipeDream-Flush) on stage `pp_rank` of `pp_world_size`: warm-up forwards, one-forward-one-backward,
    cool-down.

    The warm-up is min(p-1-pp_rank, m) forwards, so the last stage starts backward after its first forward and
    stage k never holds more than p-k micro-batches' activations (GPipe holds m).
    """
    m, p = num_microbatches, pp_world_size
    warmup = min(p - 1 - pp_rank, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]
    return order


def interleaved_stage_indices(pp_world_size: int, stages_per_rank: int, pp_rank: int) -> list[int]:
    """The stages rank `pp_rank` holds in interleaved (looped) placement: pp_rank, pp_rank + p, ...

    p=2, v=2: rank 0 holds stages 0 and 2, rank 1 holds 1 and 3, so a micro-batch visits each rank v times.
    """
    return [pp_rank + k * pp_world_size for k in range(stages_per_rank)]


def interleaved_1f1b_order(
    num_microbatches: int, pp_world_size: int, stages_per_rank: int, pp_rank: int
) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B on rank `pp_rank`: [(kind, microbatch, stage), ...] over its v stages.

    The order torch 2.13's `ScheduleInterleaved1F1B` computes (schedules.py, `_get_warmup_ops` and
    `_get_1f1b_rank_ops`; a unit test compares the two): micro-batches go in rounds of
    m // max(1, m // p); forwards walk the rank's stages upwards one round at a time, backwards downwards;
    the warm-up is (v-1) rounds plus 2 forwards per stage after this one, then one forward and one backward
    in turn.

    Raises:
        ValueError: m is not a multiple of the number of rounds (torch raises the same).
    """
    m, p, v = num_microbatches, pp_world_size, stages_per_rank
    rounds = max(1, m // p)
    if m % rounds:
        raise ValueError(
            f"interleaved 1F1B needs m to be a multiple of its rounds ({rounds}), got m={m}"
        )
    per_round = m // rounds
    warmup = min((v - 1) * per_round + 2 * (p - 1 - pp_rank), m * v)
    local = interleaved_stage_indices(p, v, pp_rank)
    done: dict[tuple[str, int], int] = defaultdict(
        int
    )  # (kind, stage) -> micro-batches already scheduled

    def action(kind: str, stage: int) -> tuple[str, int, int]:
        done[kind, stage] += 1
        return kind, done[kind, stage] - 1, stage

    order = []
    for op in range(m * v + warmup):
        if op < m * v:  # warm-up and steady state: a forward
            order.append(action("F", local[(op // per_round) % v]))
        if op >= warmup:  # steady state and cool-down: a backward
            order.append(action("B", local[v - 1 - ((op - warmup) // per_round) % v]))
    return order


def schedule_order(
    schedule: str, num_microbatches: int, pp_world_size: int, pp_rank: int, stages_per_rank: int = 1
) -> list[tuple]:
    """The order of "gpipe", "1f1b" or "interleaved-1f1b" (a "torch-" prefix is ignored) on rank `pp_rank`."""
    name, m, p = schedule.removeprefix("torch-"), num_microbatches, pp_world_size
    if name == "interleaved-1f1b":
        return interleaved_1f1b_order(m, p, stages_per_rank, pp_rank)
    if name not in ("gpipe", "1f1b"):
        raise ValueError(f"unknown schedule {schedule!r}")
    return gpipe_order(m) if name == "gpipe" else one_f_one_b_order(m, p, pp_rank)


def schedule_limit(
    schedule: str,
    batch_size: int,
    num_microbatches: int,
    pp_world_size: int,
    stages_per_rank: int = 2,
    process_group: bool = True,
    max_stages: int | None = None,
) -> str | None:
    """Why a schedule cannot run m micro-batches of N samples on p ranks (None when it can).

    torch 2.13's ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B ("torch-..." names) need a process group,
    cut the batch with `tensor_split` and fail on unequal micro-batches (lesson 09's test shows it); Schedule1F1B
    refuses m < p. Interleaved 1F1B needs p*v stages (at most `max_stages`), and fills the pipeline, meeting
    (p-1)/(v*m+p-1), only when p divides m (Megatron-LM requires it; torch's flexible version runs other m with a
    larger bubble: m=1 runs the p*v stages one after another). The hand-written "gpipe" and "1f1b" run any m <= N.
    """
    n, m, p, v = batch_size, num_microbatches, pp_world_size, stages_per_rank
    if schedule.startswith("torch") and not process_group:
        return "needs a process group (run under torchrun)"
    if schedule.startswith("torch") and n % m:
        return f"torch.distributed.pipelining needs m to divide N={n}"
    if schedule == "torch-1f1b" and m < p:
        return f"Schedule1F1B needs m >= p = {p}"
    if schedule.endswith("interleaved-1f1b") and max_stages is not None and max_stages < p * v:
        return f"needs p*v = {p * v} stages, the model can be cut into {max_stages}"
    if schedule.endswith("interleaved-1f1b") and m % p:
        return f"interleaved 1F1B fills the pipeline only when p = {p} divides m"
    return None


def peak_live_in_order(order: Sequence[tuple]) -> int:
    """Most micro-batches whose forward ran and whose backward has not, over a schedule's order (any stage)."""
    live = peak = 0
    for action in order:
        live += 1 if action[0] == "F" else -1
        peak = max(peak, live)
    return peak


def theory_bubble(pp_world_size: int, num_microbatches: int, stages_per_rank: int = 1) -> float:
    """(p-1)/(v*m+p-1): the idle fraction of p ranks of equal work running m micro-batches.

    v=1 is GPipe or 1F1B (each rank waits p-1 slots of one micro-batch's work at the start and at the end of a
    step); interleaving v stages per rank makes each slot v times shorter (Narayanan et al. 2021, section 2.2).
    """
    p, m, v = pp_world_size, num_microbatches, stages_per_rank
    return (p - 1) / (v * m + p - 1)


def theory_speedup(pp_world_size: int, num_microbatches: int) -> float:
    """Step time with m=1 over step time with m micro-batches, for p equal stages: p / ((m+p-1)/m).

    A step takes (m+p-1) slots of 1/m of the batch's per-stage work: m=1 -> p units, m=4, p=2 -> 5/4 units."""
    p, m = pp_world_size, num_microbatches
    return p / ((m + p - 1) / m)
