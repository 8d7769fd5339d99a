"""Lesson 23 launched as users launch it: torchrun with 2 processes (the claims by name, what prepare and setup
returned, the docs page's table checked row by row against the run), Fabric's own launcher and `accelerate
launch` on bad input."""

from __future__ import annotations

import importlib
import re
import sys

import pytest

from common.harness.env import LessonError
from common.run.launch import lesson_path, run_lesson
from common.run.processes import REPO_ROOT, run_command
from tests._lessons import DEV, assert_claims, assert_fails_on_every_rank, assert_lines_fit

LESSON = "23_libraries"
SECTION1 = {
    "accelerate_deals_batches_in_turn",
    "fabric_sampler_seed_from_seed_everything",
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
    # the same samples in micro-batches of [15, 1]: only the sample count is right
    "ddp_divide_by_k_uneven_changes_the_step",
    "ddp_by_samples_uneven_equals_global_step",
    "accelerate_nothing_uneven_changes_the_step",
    "fabric_divide_by_k_uneven_changes_the_step",
    "fabric_by_samples_uneven_equals_global_step",
}
SHARDING = {
    "fabric_fsdp_equals_fully_shard",
    "fabric_fsdp_collectives_equal",
    "fabric_default_data_parallel_size",
    "accelerate_fsdp2_refused_on_cpu",
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
    assert r["accelerate_fsdp2"].startswith("ValueError: ParallelismConfig is only compatible")
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


def test_train_samples_is_the_digits_training_split():
    from common.data import digits_split

    lesson = importlib.import_module(f"lessons.{LESSON}")
    assert lesson.TRAIN_SAMPLES == len(digits_split()[0]) == 1438


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch-size", "719"], "--batch-size x world_size must be < 1438"),
        (
            ["--grad-accum-steps", "90"],
            "--grad-accum-steps x --micro-batch x world_size must be <=",
        ),
    ],
)
def test_batches_the_data_cannot_fill_are_refused(monkeypatch, args, message):
    """On 2 ranks: 719 x 2 = 1438 samples a step is one batch a rank (no order to compare); 90 x 8 x 2 =
    1440 micro-batch samples are more than the digits hold. 718 and 89 pass."""
    lesson = importlib.import_module(f"lessons.{LESSON}")
    for name, value in {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2}.items():
        monkeypatch.setenv(name, str(value))  # rank 0 of torchrun's 2
    with pytest.raises(LessonError, match=re.escape(message)):
        lesson.parse_args(args)
    lesson.parse_args(["--batch-size", "718", "--grad-accum-steps", "89"])
