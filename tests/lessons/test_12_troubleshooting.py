"""Lesson 12: every exhibit's symptom (the error text or the wrong number) and its fix, from one `--show all` launch.

The whole module launches the lesson 6 times: --list (plain python), --show all and --show
uneven_batches_without_join (torchrun, 2 processes), --show collectives on 3 processes (every count follows the
world size) and --show training on 3 processes, and one bad --show name.
"""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest

from common.run.launch import run_lesson
from tests._lessons import assert_claims, assert_fails_on_every_rank, assert_lines_fit

EXHIBITS = importlib.import_module("common.exhibits.frame").load_exhibits()


@pytest.fixture(scope="module")
def shown():
    """Every exhibit, 2 processes, each broken collective bounded by --timeout-s 2: the documented
    `--show all`, one launch, so that a broken exhibit is seen not to poison the next one across groups."""
    # about 100 s on the shared 2-core machine: 26 exhibits, a dozen launches of torchrun agents among them
    run = run_lesson("12_troubleshooting", nproc=2, args=["--show", "all"], timeout_s=840).check()
    assert_lines_fit(run)
    return run


def claims_of(run, name: str, expected: set[str]) -> dict:
    """The exhibit's claims exist and hold (and every other recorded claim holds too)."""
    claims = assert_claims(run.results, {f"{name}_{c}" for c in expected})
    return {c: claims[f"{name}_{c}"]["value"] for c in expected}


def exhibit(run, name: str) -> dict:
    return run.results["exhibits"][name]


def test_the_symptom_index_names_any_lesson_in_the_tree(tmp_path, monkeypatch):
    """Which lesson teaches the right way is read from lessons/NN_*.py, so an exhibit may name any lesson in
    the tree (a later lesson's exhibit needs no list to be extended); one naming no lesson says so. No launch."""
    lesson = importlib.import_module("lessons.12_troubleshooting")
    for number, first in (
        ("22", "Lesson 22: parallel inference -- a model split"),
        ("23", "Lesson 23: a: b"),
    ):
        (tmp_path / f"{number}_x.py").write_text(f'"""{first}\n"""\n')
    assert lesson.lesson_topics(tmp_path) == {"22": "parallel inference", "23": "a"}
    in_tree = sorted(p.name[:2] for p in lesson.LESSONS_DIR.glob("[0-9][0-9]_*.py"))
    assert sorted(lesson.lesson_topics()) == in_tree
    real = lesson.load_exhibits()
    topic = lesson.lesson_topics()[in_tree[-1]]
    late = dataclasses.replace(next(iter(real.values())), name="late", lesson=in_tree[-1])
    monkeypatch.setattr(lesson, "load_exhibits", lambda: {**real, "late": late})
    last = lesson.symptom_index().splitlines()[-1]
    assert last.endswith(f"| `late` | lesson {in_tree[-1]}: {topic} |"), last
    nowhere = dataclasses.replace(late, lesson="99")
    monkeypatch.setattr(lesson, "load_exhibits", lambda: {**real, "late": nowhere})
    with pytest.raises(lesson.LessonError, match="exhibit late: no lesson 99 in"):
        lesson.symptom_index()


@pytest.mark.timeout(120)
def test_list_shows_every_exhibit():
    run = run_lesson(
        "12_troubleshooting", nproc=None, args=["--list"], timeout_s=120, results=False
    ).check()
    names = [line.split()[0] for line in run.stdout.splitlines() if line[:1].strip()]
    assert names == list(EXHIBITS) and len(names) >= 14  # each cause follows, indented
    assert_lines_fit(run)
    assert all(f"lesson {ex.lesson}" in run.stdout for ex in EXHIBITS.values())


@pytest.mark.timeout(960)
def test_every_exhibit_shown_and_every_claim_holds(shown):
    assert shown.results["shown"] == list(EXHIBITS)
    assert_claims(shown.results, set())
    assert set(shown.results["exhibits"]) == set(EXHIBITS)
    for name in EXHIBITS:  # each section printed, with its symptom and its fix
        section = shown.stdout.split(f"== {name} ")[1].split("\n== ")[0]
        assert "symptom" in section and "fix:" in section, name


@pytest.mark.timeout(960)
def test_mismatched_collectives(shown):
    c = claims_of(
        shown,
        "mismatched_collectives",
        {
            "broken_aborts",
            "op_mismatch_raises",
            "detail_names_shapes",
            "monitored_barrier_names_the_others",
            "fixed_sum",
        },
    )
    assert c["fixed_sum"] == 34.0
    ex = exhibit(shown, "mismatched_collectives")
    assert "Is there a distributed collective mismatch" in ex["symptom"][1]
    assert ex["diagnosis_detail"][1].endswith("TensorShape=[8]")
    assert "Ranks 1 failed to pass monitoredBarrier in 2000 ms" in ex["diagnosis_monitored"][0]


@pytest.mark.timeout(960)
def test_rank_skips_step(shown):
    claims_of(
        shown,
        "rank_skips_step",
        {"broken_times_out", "fixed_steps_equal", "fixed_replicas_identical"},
    )
    lines = exhibit(shown, "rank_skips_step")["symptom"]
    assert (
        "Timed out waiting 2000ms" in lines[0] and lines[1] == "finished: 2"
    )  # rank 1 ran on, silently


@pytest.mark.timeout(960)
def test_unused_parameter(shown):
    c = claims_of(shown, "unused_parameter", {"broken_raises", "info_names_aux", "fixed_trains"})
    assert (c["broken_raises"], c["info_names_aux"], c["fixed_trains"]) == (2, 2, 4)
    ex = exhibit(shown, "unused_parameter")
    assert all(
        "Expected to have finished reduction in the prior iteration" in line
        for line in ex["symptom"]
    )
    assert ex["unused"] == ["aux.bias, aux.weight"] * 2  # named by TORCH_DISTRIBUTED_DEBUG=INFO
    assert {
        "unused_parameter_find_unused_parameters_ms",
        "unused_parameter_static_graph_ms",
    } <= set(shown.results)


@pytest.mark.timeout(960)
def test_rank0_work_past_timeout(shown):
    c = claims_of(
        shown,
        "rank0_work_past_timeout",
        {"broken_rank1_times_out", "fixed_finishes", "fixed_wait_past_timeout"},
    )
    assert c["fixed_finishes"] == 2 and c["fixed_wait_past_timeout"] == 1
    assert exhibit(shown, "rank0_work_past_timeout")["fixed_wait_s"] >= 2.0  # --timeout-s 2
    assert "Timed out waiting 2000ms" in exhibit(shown, "rank0_work_past_timeout")["symptom"][1]


@pytest.mark.timeout(960)
def test_uneven_batches_without_join(shown):
    claims_of(
        shown, "uneven_batches_without_join", {"broken_rank0_times_out", "fixed_replicas_identical"}
    )
    assert exhibit(shown, "uneven_batches_without_join")["symptom"][1] == "finished: 2"


@pytest.mark.timeout(960)
def test_eval_through_ddp_on_empty_rank(shown):
    c = claims_of(shown, "eval_through_ddp_on_empty_rank", {"broken_raises", "fixed_count"})
    assert c["broken_raises"] == 2 and c["fixed_count"] == 1.0
    assert any(
        "Timed out waiting 2000ms" in line
        for line in exhibit(shown, "eval_through_ddp_on_empty_rank")["symptom"]
    )


@pytest.mark.timeout(960)
def test_set_epoch_forgotten(shown):
    c = claims_of(shown, "set_epoch_forgotten", {"broken_distinct_orders", "fixed_distinct_orders"})
    assert (c["broken_distinct_orders"], c["fixed_distinct_orders"]) == (1, 3)


@pytest.mark.timeout(960)
def test_checkpoints(shown):
    claims_of(shown, "checkpoint_module_prefix", {"broken_raises", "fixed_equal"})
    words = " ".join(shown.stdout.split())  # a long quoted error goes on over indented lines
    assert "consume_prefix_in_state_dict_if_present" in words
    assert "Unexpected key(s) in state_dict" in words and '"module.weight"' in words
    claims_of(shown, "checkpoint_weights_only", {"broken_raises", "fixed_loads"})
    assert (
        "Unsupported global: GLOBAL argparse.Namespace"
        in exhibit(shown, "checkpoint_weights_only")["symptom"]
    )


@pytest.mark.timeout(960)
def test_loading_mistakes(shown):
    claims_of(shown, "sampler_with_shuffle", {"broken_raises", "fixed_each_sample_once"})
    assert "mutually exclusive with shuffle" in exhibit(shown, "sampler_with_shuffle")["symptom"]
    c = claims_of(
        shown, "torch_load_without_map_location", {"broken_lands_on_gpu0", "fixed_on_own_device"}
    )
    assert c["broken_lands_on_gpu0"] == 2
    assert (
        "Attempting to deserialize object on a CUDA device"
        in (exhibit(shown, "torch_load_without_map_location")["symptom"])
    )
    claims_of(shown, "nccl_not_built_in", {"broken_raises", "fixed_gloo_sums"})
    assert "doesn't have NCCL built in" in exhibit(shown, "nccl_not_built_in")["symptom"]


@pytest.mark.timeout(960)
def test_each_exhibit_prints_the_fix_and_the_error_its_index_row_names(shown):
    """The symptom index's fix column is each exhibit's own `fix:` step, as the run prints it; and the run
    prints the error text the row quotes (its first 40 characters after the exception's class, numbers aside;
    `...` stands for what varies)."""
    words = " ".join(shown.stdout.split())  # a long line goes on over indented lines

    def key(text: str) -> str:
        return re.sub(r"\d+|PORT", "N", text)

    for name, ex in EXHIBITS.items():
        after = words.split(f"== {name} (lesson {ex.lesson}) ==")[1]
        part = re.split(r"== \w+ \(lesson \d\d\) ==", after)[0]
        assert ex.fix in part.split("fix: ", 1)[-1], f"{name}: the run's fix step lacks {ex.fix!r}"
        for piece in ex.symptom.split("..."):
            core = re.sub(r"^[\w.]*(Error|Exception): ", "", piece.strip())[:40]
            assert key(core) in key(part), f"{name}: the run never prints {core!r}"


@pytest.mark.timeout(960)
def test_accumulation_mistakes(shown):
    c = claims_of(shown, "no_sync_around_backward_only", {"broken_allreduces", "fixed_allreduces"})
    assert (c["broken_allreduces"], c["fixed_allreduces"]) == (4, 1)
    c = claims_of(shown, "loss_not_divided_by_k", {"broken_gradient_ratio", "fixed_gradient_diff"})
    assert (
        c["broken_gradient_ratio"] == 4.0 and c["fixed_gradient_diff"] <= 1e-6
    )  # vs the global batch
    claims_of(shown, "unscale_twice", {"broken_raises", "fixed_finite"})
    assert "unscale_() has already been called" in exhibit(shown, "unscale_twice")["symptom"]


@pytest.mark.timeout(960)
def test_batchnorm_exhibits(shown):
    claims_of(shown, "batchnorm_batch_of_one", {"broken_raises", "fixed_smallest_batch"})
    assert (
        "Expected more than 1 value per channel when training"
        in exhibit(shown, "batchnorm_batch_of_one")["symptom"]
    )
    claims_of(shown, "syncbatchnorm_on_cpu", {"broken_raises", "fixed_global_mean"})
    assert (
        "SyncBatchNorm layers only work with GPU modules"
        in exhibit(shown, "syncbatchnorm_on_cpu")["symptom"][1]
    )


@pytest.mark.timeout(960)
def test_too_many_threads(shown):
    c = claims_of(
        shown,
        "too_many_threads",
        {"broken_threads_vs_alone", "dataloader_worker_threads", "fixed_threads_per_process"},
    )
    assert (
        c["broken_threads_vs_alone"] == 2.0
    )  # mp.spawn: 2 processes, each with all a lone process takes
    assert (c["dataloader_worker_threads"], c["fixed_threads_per_process"]) == (1, 1)


@pytest.mark.timeout(960)
def test_nan_spreads_to_all_ranks(shown):
    c = claims_of(
        shown,
        "nan_spreads_to_all_ranks",
        {"broken_ranks_with_nan", "fixed_finite", "fixed_replicas_identical"},
    )
    assert c["broken_ranks_with_nan"] == 2  # only rank 1's input held a NaN


@pytest.mark.timeout(960)
def test_nan_gradient_with_finite_loss(shown):
    c = claims_of(
        shown,
        "nan_gradient_with_finite_loss",
        {
            "broken_loss_finite",
            "broken_ranks_with_nan",
            "anomaly_names_sqrt",
            "fixed_skipped",
            "fixed_params_unchanged",
        },
    )
    assert (c["broken_loss_finite"], c["broken_ranks_with_nan"], c["fixed_skipped"]) == (2, 2, 2)
    errors = exhibit(shown, "nan_gradient_with_finite_loss")["diagnosis"]
    assert (
        errors[0] == "" and "Function 'SqrtBackward0' returned nan values" in errors[1]
    )  # the outlier's rank


@pytest.mark.timeout(960)
def test_launch_mistakes(shown):
    claims_of(shown, "legacy_launcher_local_rank", {"broken_rejected", "fixed_parses"})
    assert (
        "unrecognized arguments: --local-rank=0"
        in exhibit(shown, "legacy_launcher_local_rank")["symptom"]
    )
    claims_of(
        shown, "local_rank_from_global_rank", {"broken_invalid_indices", "fixed_invalid_indices"}
    )
    assert exhibit(shown, "local_rank_from_global_rank")["ranks"] == [
        [0, 0],
        [1, 1],
        [2, 0],
        [3, 1],
    ]
    claims_of(shown, "mp_spawn_inline_function", {"broken_child_fails", "fixed_ranks"})
    assert (
        "Can't get attribute 'worker' on <module '__main__'"
        in exhibit(shown, "mp_spawn_inline_function")["symptom"]
    )


@pytest.mark.timeout(960)
def test_second_job_on_the_same_machine(shown):
    claims_of(shown, "rendezvous_port_taken", {"broken_fails", "fixed_runs"})
    assert "EADDRINUSE" in exhibit(shown, "rendezvous_port_taken")["symptom"]
    claims_of(shown, "second_job_joins_first", {"broken_first_job_killed", "fixed_jobs_alone"})
    assert "closing signal SIGTERM" in exhibit(shown, "second_job_joins_first")["symptom"]
    claims_of(
        shown, "second_job_loses_store", {"broken_second_job_dies", "fixed_second_job_finishes"}
    )
    assert (
        "RendezvousConnectionError: The connection to the C10d store has failed"
        in exhibit(shown, "second_job_loses_store")["symptom"]
    )


@pytest.mark.timeout(1200)
def test_three_ranks_every_count_follows_the_world_size():
    """At 3 ranks rank 0 (or rank 1) is still the odd one out and the others behave alike: every claim holds."""
    run = run_lesson(
        "12_troubleshooting", nproc=3, args=["--show", "collectives"], timeout_s=720
    ).check()
    c = claims_of(
        run,
        "mismatched_collectives",
        {
            "op_mismatch_raises",
            "detail_names_shapes",
            "monitored_barrier_names_the_others",
            "fixed_sum",
        },
    )
    assert (c["op_mismatch_raises"], c["fixed_sum"]) == (3, 6.0 + 2 * 28.0)
    assert (
        "Ranks 1, 2 failed to pass monitoredBarrier"
        in exhibit(run, "mismatched_collectives")["diagnosis_monitored"][0]
    )
    assert claims_of(run, "unused_parameter", {"fixed_trains"})["fixed_trains"] == 6
    assert claims_of(run, "eval_through_ddp_on_empty_rank", {"broken_raises"})["broken_raises"] == 3
    run = run_lesson(
        "12_troubleshooting", nproc=3, args=["--show", "training"], timeout_s=400
    ).check()
    assert_claims(run.results, set())  # every recorded claim holds
    assert (
        claims_of(run, "nan_spreads_to_all_ranks", {"broken_ranks_with_nan"})[
            "broken_ranks_with_nan"
        ]
        == 3
    )
    assert claims_of(run, "nan_gradient_with_finite_loss", {"fixed_skipped"})["fixed_skipped"] == 3


@pytest.mark.timeout(240)
def test_one_exhibit_alone_ends_within_its_timeout():
    run = run_lesson(
        "12_troubleshooting", nproc=2, args=["--show", "uneven_batches_without_join"], timeout_s=180
    ).check()
    assert run.results["shown"] == ["uneven_batches_without_join"]
    claims_of(
        run, "uneven_batches_without_join", {"broken_rank0_times_out", "fixed_replicas_identical"}
    )
    assert (
        run.results["uneven_batches_without_join_s"] < 30
    )  # bounded by --timeout-s 2, never a real hang


@pytest.mark.timeout(240)
def test_unknown_exhibit_fails_on_every_rank():
    run = run_lesson("12_troubleshooting", nproc=2, args=["--show", "no_such_thing"], timeout_s=180)
    assert_fails_on_every_rank(run, 2, "--show no_such_thing: no such exhibit or group")
