"""Lesson 03 launched as users launch it: torchrun with 1 and 2 processes, plain python, and two 'nodes'."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common.launch import run_command, run_lesson, torchrun_command
from tests._lessons import assert_fails_on_every_rank
from tests._workers import free_port


@pytest.fixture(scope="module")
def ddp2():
    """One default run with 2 processes and the single-process replay (reused by several tests)."""
    return run_lesson("03_ddp", nproc=2, args=["--check-equivalence"], timeout_s=240).check()


@pytest.mark.timeout(300)
def test_ddp_learns_on_two_processes(ddp2):
    r = ddp2.results
    assert (r["world_size"], r["backend"], r["global_batch_size"]) == (2, "gloo", 64)
    assert r["final_test_accuracy"] >= 0.95
    assert r["test_count"] == 359                      # every test image counted once, none twice
    assert r["history"][-1]["train_loss"] < 0.5 * r["history"][0]["train_loss"]


@pytest.mark.timeout(300)
def test_no_parameter_server_replicas_stay_identical(ddp2):
    r = ddp2.results
    assert r["max_param_diff_across_ranks"] == 0.0
    assert [f["rank"] for f in r["ranks"]] == [0, 1]
    assert [f["steps"] for f in r["ranks"]] == [92, 92]  # 1438 / 2 = 719 samples -> 23 batches x 4 epochs


@pytest.mark.timeout(300)
def test_ddp_equals_one_process_on_the_global_batch(ddp2):
    assert ddp2.results["equivalence_max_abs_diff"] < 1e-5
    assert "max |parameter difference|" in ddp2.stdout


@pytest.mark.timeout(300)
def test_order_new_each_epoch_and_identical_on_rerun(ddp2):
    firsts = [h["rank0_first_indices"] for h in ddp2.results["history"]]
    assert len({tuple(f) for f in firsts}) == len(firsts)  # a new order every epoch
    again = run_lesson("03_ddp", nproc=2, args=["--epochs", "2"], timeout_s=240).check().results
    assert [h["rank0_first_indices"] for h in again["history"]] == firsts[:2]
    assert [h["train_loss"] for h in again["history"]] == [h["train_loss"] for h in ddp2.results["history"][:2]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc", [1, None])
def test_one_process_under_torchrun_and_plain_python(nproc):
    r = run_lesson("03_ddp", nproc=nproc, args=["--epochs", "2"], timeout_s=180).check().results
    assert r["world_size"] == 1
    assert r["backend"] == ("gloo" if nproc == 1 else None)
    assert r["test_count"] == 359
    assert r["history"][-1]["test_accuracy"] > 0.9


@pytest.mark.timeout(300)
def test_checkpoint_by_rank_zero_and_resume(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    first = run_lesson("03_ddp", 2, ["--epochs", "2", "--checkpoint", str(ckpt)], 240).check().results
    assert [f["wrote_checkpoint"] for f in first["ranks"]] == [True, False]
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert state["epoch"] == 2 and not any(k.startswith("module.") for k in state["model"])  # the unwrapped model
    resumed = run_lesson("03_ddp", 2, ["--epochs", "3", "--checkpoint", str(ckpt), "--resume"], 240).check()
    full = run_lesson("03_ddp", 2, ["--epochs", "3"], 240).check().results
    assert [h["epoch"] for h in resumed.results["history"]] == [3]
    assert resumed.results["history"][0]["train_loss"] == pytest.approx(full["history"][2]["train_loss"], abs=1e-6)


@pytest.mark.timeout(300)
def test_two_nodes_on_loopback_form_one_world_of_four(tmp_path):
    """Two torchrun launches (--nnodes=2, 2 processes each) joined by a c10d rendezvous on 127.0.0.1."""
    endpoint = f"127.0.0.1:{free_port()}"
    ckpt, results = tmp_path / "ckpt.pt", tmp_path / "results.json"
    args = ["--epochs", "1", "--checkpoint", str(ckpt), "--results", str(results)]
    cmd = torchrun_command("03_ddp", 2, args, nnodes=2, rdzv_endpoint=endpoint)
    with ThreadPoolExecutor(2) as pool:  # the two "nodes" run the same command at the same time
        nodes = list(pool.map(lambda _: run_command(cmd, timeout_s=240), range(2)))
    assert [n.returncode for n in nodes] == [0, 0], [n.stderr for n in nodes]
    r = json.loads(results.read_text())
    assert r["world_size"] == 4 and r["global_batch_size"] == 4 * 32
    assert [f["rank"] for f in r["ranks"]] == [0, 1, 2, 3]
    assert [f["local_rank"] for f in r["ranks"]] == [0, 1, 0, 1]       # two processes with LOCAL_RANK 0
    assert [f["wrote_checkpoint"] for f in r["ranks"]] == [True, False, False, False]  # only global rank 0
    assert r["max_param_diff_across_ranks"] == 0.0
    assert ckpt.is_file()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, message", [
    (["--batch-size", "0"], "--batch-size must be a positive integer"),
    (["--epochs", "-2"], "--epochs must be >= 0"),
    (["--data", "no/such/file.npz"], "data file not found"),
    pytest.param(["--backend", "nccl"], "--backend nccl", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="the machine has a GPU")),
    pytest.param(["--device", "cuda"], "--device cuda", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="the machine has a GPU")),
])
def test_bad_input_fails_on_every_rank_without_hanging(args, message):
    run = run_lesson("03_ddp", nproc=2, args=args, timeout_s=90)
    assert_fails_on_every_rank(run, 2, message)
    # torchrun then reports the failed ranks with its own launcher traceback; no lesson frame may appear in it
    assert 'lessons/03_ddp.py", line' not in run.stderr
