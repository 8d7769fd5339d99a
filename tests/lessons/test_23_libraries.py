"""Lesson 23 launched as users launch it: torchrun with 2 processes (the claims by name, what prepare and setup
returned, the docs page's table checked row by row against the run), Fabric's own launcher and `accelerate
launch` on bad input."""

from __future__ import annotations

import re
import sys

import pytest

from common.run.launch import REPO_ROOT, lesson_path, run_command, run_lesson
from tests._lessons import DEV, assert_claims, assert_fails_on_every_rank, assert_lines_fit

LESSON = "23_libraries"
SECTION1 = {
    "accelerate_new_order_each_epoch",
    "fabric_calls_set_epoch",
    "fabric_default_sampler_seed",
    "fabric_equals_ddp",
    "accelerate_order_differs",
    "accelerate_equals_ddp_same_batches",
    "accelerate_allreduces_equal_ddp",
    "fabric_allreduces_equal_ddp",
    "accelerate_rng_broadcasts",
}
ACCUMULATION = {
    f"{lib}_{how}_{what}"
    for lib, rights in {
        "ddp": ("divide_by_k", "by_samples"),
        "accelerate": ("nothing",),
        "fabric": ("divide_by_k", "by_samples"),
    }.items()
    for how in rights
    for what in ("equals_global_step", "allreduce_calls")
} | {
    "ddp_nothing_changes_the_step",
    "accelerate_divide_by_k_changes_the_step",
    "accelerate_by_samples_changes_the_step",
    "fabric_nothing_changes_the_step",
}
SHARDING = {
    "fabric_fsdp_equals_fully_shard",
    "fabric_fsdp_collectives_equal",
    "fabric_default_data_parallel_size",
}


@pytest.fixture(scope="module")
def two_ranks():
    return run_lesson(LESSON, nproc=2, args=DEV, timeout_s=360).check()


@pytest.mark.timeout(400)
def test_every_claim_on_two_ranks(two_ranks):
    r = two_ranks.results
    assert set(r["claims"]) == SECTION1 | ACCUMULATION | SHARDING
    assert_claims(r, SECTION1 | ACCUMULATION | SHARDING)
    assert two_ranks.stdout.rstrip().endswith(f"{len(r['claims'])} checks hold")
    assert_lines_fit(two_ranks)


@pytest.mark.timeout(400)
def test_what_prepare_and_setup_returned(two_ranks):
    r = two_ranks.results
    for name in ("by_hand", "accelerate", "fabric"):
        row = r[f"{name}_setup"]
        assert row["wrapper"] == "DistributedDataParallel" and row["backend"] == "gloo", row
        assert row["set_epoch"] is True
    assert r["fabric_setup"]["sampler"] == "DistributedSampler" and r["fabric_setup"]["seed"] == 0
    assert r["accelerate_setup"]["sampler"] == "BatchSamplerShard"
    assert r["accelerate_inner_sampler"] == "RandomSampler"  # the DataLoader's own, kept
    # the mesh dims each library's configuration builds
    assert r["fabric_mesh"] == [["data_parallel", "tensor_parallel"], [2, 1]]
    assert r["fabric_default_mesh"] == [["data_parallel", "tensor_parallel"], [1, 2]]
    assert r["accelerate_mesh"] == [["dp_shard"], [2]]
    assert r["accelerate_fsdp2"].startswith("MULTI_CPU")  # no FSDP on CPU: recorded, not claimed
    assert r["round_allreduce_calls"] == 2  # ResidualMLP's buckets: 1 MiB, then the rest


def table_rows(text: str) -> list[list[str]]:
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| `")]
    return [[c.strip().strip("`") for c in row] for row in rows]


@pytest.mark.timeout(400)
def test_docs_table_rows_are_proved_by_the_run(two_ranks):
    claims = two_ranks.results["claims"]
    for page in ("docs/libraries.md", "docs/zh/libraries.md"):
        rows = table_rows((REPO_ROOT / page).read_text("utf-8"))
        assert len(rows) >= 12, page
        for call, _, lesson, torch_name, claim in rows:
            assert claims[claim]["holds"], (page, call, claim)
            source = next((REPO_ROOT / "lessons").glob(f"{lesson}_*.py")).read_text("utf-8")
            assert torch_name in source, f"{page}: lesson {lesson} never names {torch_name!r}"
    en = [row[-1] for row in table_rows((REPO_ROOT / "docs/libraries.md").read_text("utf-8"))]
    zh = [row[-1] for row in table_rows((REPO_ROOT / "docs/zh/libraries.md").read_text("utf-8"))]
    assert en == zh


def test_bad_input_under_fabric_run_fails_on_every_rank():
    """Fabric's launcher starts 2 processes (torchrun underneath): one error line from each."""
    fabric = [sys.executable, "-m", "lightning_fabric.cli"]  # the `fabric run` command
    cmd = [*fabric, "--accelerator", "cpu", "--devices", "2", str(lesson_path(LESSON))]
    run = run_command([*cmd, "--grad-accum-steps", "1"], timeout_s=120)
    assert_fails_on_every_rank(run, 2, "--grad-accum-steps must be >= 2")


def test_accelerate_launch_on_cpu_starts_one_process():
    """`accelerate launch --cpu --num_processes 2` runs its simple launcher on a CPU machine: ONE process,
    no RANK (multi-CPU goes through mpirun): the lesson's one-process error line, no [rank R] prefix."""
    accelerate = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--cpu",
        "--num_processes",
        "2",
    ]
    fixed = ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd = [*accelerate, *fixed, str(lesson_path(LESSON)), "--grad-accum-steps", "1"]
    run = run_command(cmd, timeout_s=120)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if "--grad-accum-steps must be" in line]
    assert errors and all(re.match(r"error: ", line) for line in errors[:1]), run.stderr
    assert "[rank 1]" not in run.stderr
