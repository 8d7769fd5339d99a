"""common.measure.profiling (intervals from a torch.profiler trace), common.performance.buckets (DDP's buckets,
counted) and common.compression.hooks (PyTorch's hooks by name), checked on hand-made traces with known answers
and in one small 2-rank gloo world."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from common.compression.hooks import comm_hook, powersgd_rank
from common.measure.profiling import (
    intersect_length,
    is_allreduce,
    load_trace,
    step_profiles,
    summarize,
    union_length,
)
from common.performance.buckets import predicted_buckets
from tests._workers import run_world


def ev(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid}


def two_steps():
    """Step 1 (us 0..100): backward nodes 30..40 and 45..70, buckets issued at 42 and at 62 (inside the second
    node: it computes until 62); all-reduces 50..60 (hidden) and 65..90 (exposed). Step 2 (us 100..200): one
    node 130..170 that issues the only bucket at 168; its all-reduce 175..185 comes after: nothing hidden."""
    out = []
    for t0, nodes, comm, issues in (
        (0, [(30, 10), (45, 25)], [(50, 10), (65, 25)], [42, 62]),
        (100, [(30, 40)], [(75, 10)], [68]),
    ):
        out += [
            ev("forward", t0, 25, "user_annotation"),
            ev("backward", t0 + 28, 64, "user_annotation"),
            ev("optimizer", t0 + 93, 5, "user_annotation"),
        ]
        out += [
            ev("autograd::engine::evaluate_function: AddmmBackward0", t0 + s, d) for s, d in nodes
        ]
        out += [ev("gloo:all_reduce", t0 + s, d, tid=2) for s, d in comm]
        out += [ev("c10d::allreduce_", t0 + i, 1) for i in issues]  # the caller enqueues a bucket
    return out


def test_union_and_intersection():
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_length([]) == 0
    assert intersect_length([(0, 10), (5, 15)], (4, 12)) == 8
    assert intersect_length([(0, 2)], (3, 4)) == 0


def test_is_allreduce_names():
    assert is_allreduce("gloo:all_reduce") and is_allreduce("nccl:all_reduce")
    assert is_allreduce("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
    assert not is_allreduce("c10d::allreduce_") and not is_allreduce("aten::mm")


def test_step_profiles_on_a_known_trace(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(
        json.dumps({"traceEvents": two_steps() + [{"ph": "M", "name": "process_name"}]})
    )
    s1, s2 = step_profiles(load_trace(path))
    assert s1.backward_window == (0.030, 0.062) and s1.backward_ops == 2
    assert s1.allreduce == [(0.050, 0.060), (0.065, 0.090)]
    assert s1.allreduce_ms == pytest.approx(0.035) and s1.hidden_ms == pytest.approx(0.010)
    assert s1.hidden_fraction == pytest.approx(10 / 35)
    assert s1.ops_after_first_issue == 1  # issued at 42: the node at 45 is still to run
    assert (
        s2.hidden_ms == 0
        and s2.exposed_ms == pytest.approx(0.010)
        and s2.ops_after_first_issue == 0
    )
    summary = summarize([s1, s2])
    assert summary["allreduces_per_step"] == [2, 1]
    assert summary["hidden_fraction"] == pytest.approx(10 / 45)
    assert s2.backward_window == (0.030, 0.068)  # the node ends at 170 but issued the bucket at 168


def test_step_profiles_needs_the_phase_ranges():
    with pytest.raises(ValueError, match="record_function range per phase"):
        step_profiles([ev("aten::mm", 0, 1)])


def test_predicted_buckets_rule():
    """Reverse parameter order, close a bucket at >= its cap, the first bucket's own cap."""
    module = torch.nn.Sequential(
        torch.nn.Linear(4, 4, bias=False),
        torch.nn.Linear(4, 4, bias=False),
        torch.nn.Linear(4, 4, bias=False),
    )  # 3 x 64 bytes
    fake = lambda first, cap: SimpleNamespace(  # noqa: E731
        module=module,
        bucket_bytes_cap=cap,
        _bucket_config=SimpleNamespace(first_bucket_bytes_cap=first),
    )
    assert predicted_buckets(fake(64, 64)) == 3
    assert predicted_buckets(fake(64, 128)) == 2
    assert predicted_buckets(fake(1000, 1000)) == 1
    assert (
        predicted_buckets(fake(1000, 1000), first_bucket_bytes=64) == 2
    )  # DDPOptimizer's first graph


def test_comm_hook_names():
    assert powersgd_rank("powersgd4") == 4 and powersgd_rank("bf16") == 0
    assert comm_hook("bf16")[0].__name__ != "bf16_compress_hook"  # DDP refuses that name off CUDA
    assert comm_hook("powersgd2")[1].matrix_approximation_rank == 2
    with pytest.raises(ValueError, match="unknown comm hook"):
        comm_hook("powersgd0")


@pytest.mark.timeout(120)
def test_hooks_on_gloo(tmp_path):
    """On gloo: bf16 and fp16 hooks average like the plain all-reduce (within their rounding); all-reduce calls
    equal DDP's rule once buckets are rebuilt; gradient_as_bucket_view saves exactly one gradient copy."""
    from tests._17_workers import hooks_on_gloo

    r0, r1 = run_world(hooks_on_gloo, 2, tmp_path)
    assert r0["rel"] == r1["rel"]
    assert r0["rel"]["bf16"] <= 2**-7 and r0["rel"]["fp16"] <= 2**-10
    for cap, (calls, predicted) in r0["counts"].items():
        assert calls[0] == 1 and calls[1] == predicted, cap
    assert (
        r0["counts"][0.1][1] > r0["counts"][None][1]
    )  # a sweep that really changes the bucket count
    assert r0["storage"][False] - r0["storage"][True] == r0["param_bytes"]


def test_cuda_trace_counts_kernels_not_the_cpu_ranges():
    """On CUDA the NCCL kernel is the all-reduce; the CPU's "nccl:all_reduce" range only enqueues it."""
    events = [
        ev("forward", 0, 10, "user_annotation"),
        ev("backward", 10, 30, "user_annotation"),
        ev("optimizer", 45, 5, "user_annotation"),
        ev("nccl:all_reduce", 20, 1, "user_annotation"),
        ev("ampere_sgemm_64x64_nn", 12, 18, "kernel"),
        ev(
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            25,
            15,
            "kernel",
        ),
    ]
    (step,) = step_profiles(events)
    assert step.allreduce == [(0.025, 0.040)] and step.backward_window == (0.012, 0.030)
    assert step.hidden_ms == pytest.approx(0.005)
