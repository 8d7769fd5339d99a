"""minimal/19_context_parallel.py held to PyTorch's own attention: its ring attention forward (isend/irecv
and the log-sum-exp merge) equals F.scaled_dot_product_attention(is_causal=True) on the whole sequence, and
each rank sends cp - 1 key/value blocks, the numbers lesson 19 claims (ring_contiguous_equals_sdpa,
ring_forward_bytes_sent). The script checks the equality itself and exits non-zero otherwise; its check
says no on every rank when one rank other than 0 is wrong or NaN."""

from __future__ import annotations

import json

import pytest

from common.run.launch import run_lesson
from common.run.processes import REPO_ROOT
from tests._19_workers import minimal_19_check
from tests._workers import run_world

CPU = {"CUDA_VISIBLE_DEVICES": ""}
SCRIPT = REPO_ROOT / "minimal" / "19_context_parallel.py"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc", [2, 4, None])
def test_19_ring_attention_equals_sdpa_and_sends_cp_minus_1_blocks(nproc):
    run = run_lesson(SCRIPT, nproc, [], 240, env=CPU, results=False).check()
    (got,) = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    cp = nproc or 1
    assert got["cp"] == cp
    assert got["max_diff"] <= 1e-5  # lesson 19's bound (float32; measured ~1e-7)
    assert got["sent_bytes"] == (cp - 1) * got["kv_block_bytes"]
    assert (
        got["kv_block_bytes"] == 2 * 2 * 4 * (64 // cp) * 8 * 4
    )  # k and v: (B, H, S/cp, D) float32


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad, verdict", [(1e-7, True), (0.5, False), (float("nan"), False)])
def test_19_check_fails_on_every_rank_when_rank_1_alone_is_wrong(bad, verdict, tmp_path):
    """A check that reduced the diffs with MIN, or with gloo's MAX (which drops a NaN off rank 0), would
    say yes here; the script's check() must say no on both ranks."""
    assert run_world(minimal_19_check, 2, tmp_path, bad) == [verdict, verdict]
