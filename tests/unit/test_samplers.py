"""Unit tests of the samplers and seeding helpers (common/data_parallel/samplers.py, common/data_parallel/bucketing.py, common/data_parallel/seeding.py) and of
lesson 04's and 05's pure functions: hypothesis properties, given cases, bad input. No torchrun: a sampler takes
(num_replicas, rank) directly, so every rank of a world is built in this one process."""

import runpy
from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from common.data_parallel.bucketing import (
    LengthGroupedDistributedBatchSampler,
    padded_token_fraction,
    padded_tokens,
)
from common.data_parallel.sampler_len import BlogShardSampler, blog_steps_differ, len_vs_yield
from common.data_parallel.samplers import (
    DistributedSamplerByHand,
    UnpaddedDistributedSampler,
    count_matching_configs,
    distributed_indices,
)
from common.data_parallel.seeding import (
    augmentation_streams,
    generator_draws,
    loader_generator,
    rank_seed,
    seed_data_rngs,
    stream_summary,
)
from common.data_parallel.weighted_sampler import (
    WeightedDistributedSampler,
    interleave,
    weighted_union_vs_torch,
)
from common.harness.env import DistInfo, LessonError
from common.harness.metrics import evaluate
from common.harness.session import set_seed
from common.run.processes import REPO_ROOT

sizes = st.integers(0, 200)
worlds = st.integers(1, 8)
seeds = st.integers(0, 2**16)
epochs = st.integers(0, 50)


def all_ranks(make, world_size, epoch=0):
    """[list(sampler of rank r) for every r], each sampler set to `epoch`; also checks len == what it yields."""
    out = []
    for r in range(world_size):
        s = make(r)
        s.set_epoch(epoch)
        items = list(s)
        assert len(s) == len(items), f"rank {r}: len {len(s)} but yields {len(items)}"
        out.append(items)
    return out


# ------------------------------------------ DistributedSampler by hand ------------------------------------------
@given(n=sizes, w=worlds, shuffle=st.booleans(), drop_last=st.booleans(), seed=seeds, epoch=epochs)
def test_by_hand_equals_torch_distributed_sampler(n, w, shuffle, drop_last, seed, epoch):
    for r in range(w):
        ref = DistributedSampler(
            range(n), num_replicas=w, rank=r, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        ref.set_epoch(epoch)
        mine = DistributedSamplerByHand(n, w, r, shuffle, seed, drop_last)
        mine.set_epoch(epoch)
        assert list(mine) == list(ref)
        assert len(mine) == len(ref)
        assert distributed_indices(n, w, r, shuffle, seed, epoch, drop_last).tolist() == list(ref)


@given(n=st.integers(1, 200), w=worlds, drop_last=st.booleans(), seed=seeds, epoch=epochs)
def test_by_hand_coverage_padding_and_determinism(n, w, drop_last, seed, epoch):
    per_rank = all_ranks(
        lambda r: DistributedSamplerByHand(n, w, r, True, seed, drop_last), w, epoch
    )
    assert len({len(p) for p in per_rank}) == 1  # the same number of samples on every rank
    counts = Counter(i for p in per_rank for i in p)
    total = sum(counts.values())
    if drop_last:
        assert (
            total == n - n % w and max(counts.values(), default=1) == 1
        )  # the tail dropped, nothing repeated
    else:
        assert set(counts) == set(range(n))  # no sample lost
        assert total - n == (-n) % w  # repeats are exactly the padding
    assert per_rank == all_ranks(
        lambda r: DistributedSamplerByHand(n, w, r, True, seed, drop_last), w, epoch
    )


def test_set_epoch_changes_order():
    for make in (
        lambda: DistributedSamplerByHand(100, 2, 1, seed=3),
        lambda: UnpaddedDistributedSampler(100, 2, 1, shuffle=True, seed=3),
        lambda: WeightedDistributedSampler(torch.ones(100), 2, 1, seed=3),
        lambda: LengthGroupedDistributedBatchSampler(
            torch.arange(100), 4, 2, 1, seed=3, pool_batches=5
        ),
    ):
        s = make()
        first = list(s)
        s.set_epoch(1)
        assert list(s) != first
        s.set_epoch(0)
        assert list(s) == first and list(make()) == first


# ------------------------------------------ unpadded evaluation sampler ------------------------------------------
@given(n=sizes, w=worlds, shuffle=st.booleans(), seed=seeds, epoch=epochs)
def test_unpadded_every_sample_once_shards_differ_by_at_most_one(n, w, shuffle, seed, epoch):
    per_rank = all_ranks(lambda r: UnpaddedDistributedSampler(n, w, r, shuffle, seed), w, epoch)
    assert sorted(i for p in per_rank for i in p) == list(range(n))
    assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 1


# --------------------------------------------- weighted sampler ---------------------------------------------
weights_st = st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=60).filter(
    lambda w: sum(w) > 0
)


@given(weights=weights_st, w=worlds, seed=seeds, epoch=epochs, num=st.integers(1, 150))
def test_weighted_lengths_support_and_equality_with_torch(weights, w, seed, epoch, num):
    per_rank = all_ranks(
        lambda r: WeightedDistributedSampler(weights, w, r, num_samples=num, seed=seed), w, epoch
    )
    assert len({len(p) for p in per_rank}) == 1
    assert all(weights[i] > 0 for p in per_rank for i in p)  # zero weight: never drawn
    # Interleaving the ranks gives exactly WeightedRandomSampler's draw from a generator seeded seed + epoch.
    total = w * len(per_rank[0])
    g = torch.Generator().manual_seed(seed + epoch)
    interleaved = [per_rank[k % w][k // w] for k in range(total)]
    assert interleaved == list(WeightedRandomSampler(weights, total, replacement=True, generator=g))


@given(n=st.integers(1, 60), w=worlds, seed=seeds)
def test_weighted_without_replacement_repeats_only_padding(n, w, seed):
    weights = (
        torch.rand(n, generator=torch.Generator().manual_seed(seed)) + 0.01
    )  # the same on every rank
    per_rank = all_ranks(
        lambda r: WeightedDistributedSampler(weights, w, r, replacement=False, seed=seed), w
    )
    counts = Counter(i for p in per_rank for i in p)
    assert set(counts) == set(range(n)) and sum(counts.values()) - n == (-n) % w


def test_weighted_ranks_draw_different_streams_and_rebalance():
    labels = torch.tensor([0] * 900 + [1] * 100)
    weights = 1.0 / torch.bincount(labels)[labels].double()
    a, b = (list(WeightedDistributedSampler(weights, 2, r, seed=0)) for r in range(2))
    assert a != b
    share = (
        labels[torch.tensor(a)].float().mean().item()
    )  # class 1 is 10% of the data, ~50% of the draws
    assert 0.4 < share < 0.6


# ------------------------------------------ length-grouped batch sampler ------------------------------------------
@given(
    lengths=st.lists(st.integers(0, 300), min_size=0, max_size=150),
    b=st.integers(1, 9),
    w=worlds,
    pool=st.integers(1, 6),
    drop_last=st.booleans(),
    seed=seeds,
    epoch=epochs,
)
def test_length_grouped_batches(lengths, b, w, pool, drop_last, seed, epoch):
    make = lambda r: LengthGroupedDistributedBatchSampler(lengths, b, w, r, seed, pool, drop_last)  # noqa: E731
    per_rank = all_ranks(make, w, epoch)
    assert len({len(p) for p in per_rank}) == 1  # the same number of batches on every rank
    batches = [bt for p in per_rank for bt in p]
    assert all(1 <= len(bt) <= b for bt in batches)
    counts = Counter(i for bt in batches for i in bt)
    n, nb = len(lengths), -(-len(lengths) // b)
    if not drop_last:
        assert set(counts) == set(range(n))  # no sample lost
        assert sum(counts.values()) - n <= ((-nb) % w) * b  # repeats only in the padding batches
    else:
        assert max(counts.values(), default=1) == 1 and len(batches) == (nb // w) * w
    assert per_rank == all_ranks(make, w, epoch)  # same seed and epoch, same batches


def test_length_grouped_cuts_padding_by_more_than_half():
    g = torch.Generator().manual_seed(0)
    lengths = (torch.randn(4000, generator=g) * 0.8 + 4).exp().round().clamp(4, 512).long()
    rand = list(DistributedSampler(range(4000), 2, 0, seed=0))
    random_batches = [rand[i : i + 16] for i in range(0, len(rand), 16)]
    grouped = list(LengthGroupedDistributedBatchSampler(lengths, 16, 2, 0, seed=0))
    assert padded_token_fraction(grouped, lengths) < 0.5 * padded_token_fraction(
        random_batches, lengths
    )


def test_padded_tokens_worked_example():
    assert padded_tokens([[0, 1, 2]], [3, 5, 8]) == (16, 24)
    assert padded_token_fraction([[0, 1, 2]], [3, 5, 8]) == pytest.approx(1 / 3)


# ------------------------------------------ given case: 11 samples, batch 2, 2 ranks ------------------------------
def test_eleven_samples_batch_two_two_ranks():
    for drop_last in (False, True):
        yielded = []
        for r in range(2):
            loader = DataLoader(
                range(11),
                batch_size=2,
                drop_last=drop_last,
                sampler=DistributedSamplerByHand(11, 2, r, seed=0),
            )
            n_batches = sum(1 for _ in loader)
            assert len(loader) == n_batches == 3
            yielded.append(n_batches)
        assert yielded[0] == yielded[1]
    for r in range(2):
        s = LengthGroupedDistributedBatchSampler(list(range(1, 12)), 2, 2, r, seed=0)
        assert len(s) == len(list(s)) == 3
        assert len(DataLoader(range(11), batch_sampler=s)) == 3


# --------------------------------------------- bad input ---------------------------------------------
@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: DistributedSamplerByHand(10, 0, 0), "num_replicas"),
        (lambda: DistributedSamplerByHand(10, 2, 2), "rank must be in [0, 2)"),
        (lambda: UnpaddedDistributedSampler(10, 2, -1), "rank must be in [0, 2)"),
        (lambda: WeightedDistributedSampler([1.0, -0.5], 2, 0), "weights must be >= 0"),
        (lambda: WeightedDistributedSampler([0.0, 0.0], 2, 0), "all zero"),
        (lambda: WeightedDistributedSampler([1.0, float("nan")], 2, 0), "finite"),
        (
            lambda: WeightedDistributedSampler([1.0, 0.0], 1, 0, num_samples=2, replacement=False),
            "without replacement",
        ),
        (lambda: LengthGroupedDistributedBatchSampler([3, 4], 0, 2, 0), "batch_size"),
        (lambda: LengthGroupedDistributedBatchSampler([3, 4], 2, 0, 0), "num_replicas"),
        (lambda: LengthGroupedDistributedBatchSampler([3, -4], 2, 1, 0), "lengths must be >= 0"),
    ],
)
def test_bad_input_raises_one_clear_line(make, message):
    with pytest.raises(ValueError) as e:
        make()
    assert message in str(e.value) and "\n" not in str(e.value)


# ------------------------------ weighted without replacement ------------------------------
@given(n=st.integers(1, 60), w=worlds, seed=seeds, epoch=epochs, data=st.data())
def test_weighted_without_replacement_is_torch_draw_plus_padding(n, w, seed, epoch, data):
    """The promise as fixed: the interleaved ranks are WeightedRandomSampler(weights, num_samples, False) followed by
    repeats of its start; equal to that sampler's draw of all W * ceil(num_samples / W) positions only when W
    divides num_samples (the old promise said always)."""
    weights = (torch.rand(n, generator=torch.Generator().manual_seed(seed)) + 0.01).tolist()
    num = data.draw(st.integers(1, n))
    per_rank = all_ranks(
        lambda r: WeightedDistributedSampler(weights, w, r, num, False, seed), w, epoch
    )
    union = [per_rank[k % w][k // w] for k in range(w * len(per_rank[0]))]
    g = lambda: torch.Generator().manual_seed(seed + epoch)  # noqa: E731
    assert union[:num] == list(
        WeightedRandomSampler(weights, num, replacement=False, generator=g())
    )
    assert union[num:] == union[: len(union) - num]  # the padding repeats the start
    assert len(set(union[:num])) == num  # no sample twice before the padding
    if (
        len(union) <= n and num % w
    ):  # the old promise, where torch can draw that many: it does not hold
        assert union != list(
            WeightedRandomSampler(weights, len(union), replacement=False, generator=g())
        )


# ------------------------------ __len__ and step counts of the blog sampler (lesson 04) ------------------------------
@given(n=st.integers(1, 120), w=worlds, b=st.integers(1, 9), drop_last=st.booleans())
def test_blog_step_rule_matches_what_ranks_run(n, w, b, drop_last):
    steps = [len(list(BatchSampler(BlogShardSampler(n, w, r), b, drop_last))) for r in range(w)]
    assert (len(set(steps)) > 1) == blog_steps_differ(n, w, b, drop_last)
    loader = DataLoader(
        range(n), batch_size=b, sampler=BlogShardSampler(n, w, 0), drop_last=drop_last
    )
    assert len(loader) == (
        n // b if drop_last else -(-n // b)
    )  # the dataset's batches, whatever rank 0 yields


def test_blog_sampler_given_case_says_6_yields_3():
    """11 samples, batch 2, 2 ranks: len(DataLoader) says 6, each rank yields 3; with drop_last [3, 2] steps."""
    rows = [len_vs_yield(BlogShardSampler(11, 2, r), 2, False) for r in range(2)]
    assert rows == [{"len": 6, "yielded": 3}] * 2
    assert [len_vs_yield(BlogShardSampler(11, 2, r), 2, True)["yielded"] for r in range(2)] == [
        3,
        2,
    ]
    assert not blog_steps_differ(11, 2, 2, False) and blog_steps_differ(9, 2, 2, False)


def test_by_hand_matches_torch_on_the_lesson_grid():
    match, total = count_matching_configs()
    assert match == total == 832


def test_weighted_union_is_torchs_draw_with_replacement_and_its_draw_plus_padding_without():
    """5 weights, 2 ranks, 3 draws without replacement fill 4 positions: the 4th repeats the first."""
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float64)
    with_r = [list(WeightedDistributedSampler(weights, 2, r, seed=3)) for r in range(2)]
    without = [list(WeightedDistributedSampler(weights, 2, r, 3, False, 3)) for r in range(2)]
    assert interleave([[0, 2, 4], [1, 3]]) == [0, 1, 2, 3, 4]
    union = weighted_union_vs_torch(weights, with_r, without, 3, 3)
    assert union == {"with": True, "padded": True, "whole": False, "positions": 4}


# ------------------------------ evaluation on fewer samples than ranks ----------------------------
def test_unpadded_sampler_smaller_than_world():
    assert [list(UnpaddedDistributedSampler(1, 2, r)) for r in range(2)] == [[0], []]
    assert [len(UnpaddedDistributedSampler(2, 3, r)) for r in range(3)] == [1, 1, 0]


def test_metrics_evaluate_refuses_an_empty_dataset():
    empty = TensorDataset(torch.zeros(0, 1, 8, 8), torch.zeros(0, dtype=torch.long))
    with pytest.raises(LessonError, match="empty"):
        evaluate(torch.nn.Flatten(), empty, DistInfo())


# ------------------------------------ seeding ------------------------------------
def test_rank_seed_and_loader_generator():
    assert (
        rank_seed(0, 0) == rank_seed(0, 0)
        and len({rank_seed(s, r) for s in range(3) for r in range(3)}) == 9
    )
    draws = [
        torch.empty((), dtype=torch.int64).random_(generator=loader_generator(5, r)).item()
        for r in (0, 1, 0)
    ]
    assert draws[0] != draws[1] and draws[0] == draws[2]


def ranks_streams(workers: int, fix: bool, seed: int = 3, world_size: int = 2) -> dict:
    """The augmentation streams each simulated rank draws after `set_seed(seed)` (what lesson 03 does on every
    rank), with seed_data_rngs (fix) or with loader_generator alone."""
    per_rank = []
    for rank in range(world_size):
        set_seed(seed)
        gen = seed_data_rngs(seed, rank) if fix else loader_generator(seed, rank)
        per_rank.append(augmentation_streams(4, workers, gen))
    return stream_summary(per_rank)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_seed_data_rngs_gives_each_rank_its_own_streams(workers):
    fixed = ranks_streams(workers, fix=True)
    assert fixed["identical_pairs"] == [] and fixed["num_distinct"] == 2 * max(workers, 1)
    assert all(v == 2 * max(workers, 1) for v in fixed["distinct_per_library"].values())
    assert ranks_streams(workers, fix=True) == fixed  # reproducible
    # loader_generator alone: enough with workers, but with 0 workers both ranks draw the same augmentations
    assert ranks_streams(workers, fix=False)["identical_pairs"] == (
        [] if workers else ["r0w-1=r1w-1"]
    )


@pytest.mark.timeout(60)
def test_base_seed_drawn_per_epoch_except_with_persistent_workers():
    for persistent, draws in ((False, 2), (True, 1)):
        g = loader_generator(0, 1)
        augmentation_streams(4, 1, g, epochs=2, persistent=persistent)
        assert generator_draws(g, 0, 1) == draws


# --------------------------------------------- the benchmark ---------------------------------------------
@pytest.mark.timeout(60)
def test_sampler_benchmark_prints_perf_lines_only(capsys):
    bench = runpy.run_path(
        str(REPO_ROOT / "benchmarks" / "sampler_speed.py")
    )  # its globals; main() not run
    threads = torch.get_num_threads()
    try:
        bench["main"](["--size", "10000", "--repeats", "1"])
    finally:
        torch.set_num_threads(threads)  # main() sets 1 thread for the whole process
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and all(line.startswith("[perf]") for line in lines)
    assert (
        "5000 items" in lines[0] and "157 items" in lines[-1]
    )  # 10^4 / 2 samples; ceil(ceil(10^4 / 32) / 2) batches
