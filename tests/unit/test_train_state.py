"""The full training-state checkpoint (common/checkpoint/train_state.py) and the fault timeline (common/fault_tolerance/timeline.py), in one
process: no torchrun, a few seconds in all. The crash-and-restart runs are in tests/lessons/test_16_fault_tolerance.py.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from common.checkpoint.rng_state import capture_rng, restore_rng
from common.checkpoint.train_state import (
    ResumableDistributedSampler,
    check_same_run,
    find_latest,
    leftovers,
    load_train_state,
    model_signature,
    roundtrip,
    save_train_state,
)
from common.fault_tolerance.faults import parse_faults
from common.fault_tolerance.timeline import timeline
from common.harness.env import DistInfo, LessonError

SIG = {"w": [2, 2]}


def draws(gen):
    """One draw from each stream a training step may use: torch, a generator, numpy (incl. its cached Gaussian),
    random."""
    return (
        torch.rand(3).tolist(),
        torch.rand(2, generator=gen).tolist(),
        np.random.rand(2).tolist(),
        [random.random() for _ in range(2)],
        float(np.random.randn()),
    )


@pytest.mark.timeout(30)
def test_rng_streams_restore_exactly_through_a_file():
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    np.random.randn()  # leaves a cached Gaussian in numpy's state (has_gauss = 1)
    state = roundtrip(
        capture_rng(gen, torch.device("cpu"))
    )  # through torch.save / weights_only load
    first = draws(gen)
    torch.manual_seed(99), np.random.seed(99), random.seed(99), gen.manual_seed(99)
    restore_rng(state, gen, torch.device("cpu"))
    assert draws(gen) == first


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_sampler_resumes_mid_epoch_without_rereading(world_size):
    data = list(range(48))
    G = 8  # global batch
    whole = [
        list(ResumableDistributedSampler(data, world_size, r, seed=0, samples_per_epoch=48))
        for r in range(world_size)
    ]
    resumed = []
    for r in range(world_size):
        s = ResumableDistributedSampler(data, world_size, r, seed=0, samples_per_epoch=48)
        s.advance(3 * G)  # three optimizer steps done
        state = s.state_dict()
        t = ResumableDistributedSampler(data, world_size, r, seed=0, samples_per_epoch=48)
        t.load_state_dict(state)
        resumed.append(list(t))
        assert len(t) == len(resumed[-1]) == (48 - 3 * G) // world_size
    for r in range(world_size):  # the rest of the same list: skipped samples are the trained ones
        assert resumed[r] == whole[r][3 * G // world_size :]
    # the global batch of step t is perm[t*G:(t+1)*G] for any world size (per-rank batch G / world_size)
    b = G // world_size
    step3 = sorted(i for r in range(world_size) for i in whole[r][3 * b : 4 * b])
    one = list(ResumableDistributedSampler(data, 1, 0, seed=0, samples_per_epoch=48))
    assert step3 == sorted(one[3 * G : 4 * G])


@pytest.mark.timeout(30)
def test_sampler_rolls_over_to_the_next_epoch():
    s = ResumableDistributedSampler(list(range(16)), 2, 0, seed=0, samples_per_epoch=16)
    first = list(s)
    s.advance(16)
    assert s.state_dict() == {"epoch": 1, "seen": 0} and list(s) != first
    with pytest.raises(LessonError):
        s.load_state_dict({"epoch": 0, "seen": 3})  # not a whole number of samples per rank


@pytest.mark.timeout(30)
def test_complete_checkpoints_only(tmp_path):
    info = DistInfo()
    for step in (4, 8):
        save_train_state({"step": step, "x": torch.arange(3.0) * step}, tmp_path, step, info, SIG)
    path, meta = find_latest(tmp_path)
    assert meta["step"] == 8 and load_train_state(path, torch.device("cpu"))["x"].tolist() == [
        0.0,
        8.0,
        16.0,
    ]
    # a .pt whose bytes no longer match its marker (a torn or overwritten file) is skipped: step 4 loads
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert find_latest(tmp_path)[1]["step"] == 4 and leftovers(tmp_path) == ["step_000008.pt"]
    # keep=2: a third save removes the oldest complete one
    save_train_state({"step": 12}, tmp_path, 12, info, SIG)
    assert sorted(p.name for p in tmp_path.glob("step_*.json")) == [
        "step_000008.json",
        "step_000012.json",
    ]


KILLED_WRITER = """
import sys, torch
from common.harness.env import DistInfo
from common.fault_tolerance.faults import Fault, EventLog
from common.checkpoint.train_state import save_train_state
d = sys.argv[1]
save_train_state({"step": 4, "x": torch.zeros(1000)}, d, 4, DistInfo(), {"w": [2, 2]})
log = EventLog(d + "/events.jsonl", 0, 0)
save_train_state({"step": 8, "x": torch.ones(1000)}, d, 8, DistInfo(), {"w": [2, 2]},
                 fault=Fault(sys.argv[2], 8, 0).writer_hook(8, log))
print("not reached")
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point", ["mid-write", "before-rename"])
def test_killed_writer_leaves_the_previous_checkpoint(tmp_path, point):
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KILLED_WRITER), str(tmp_path), point],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 1 and "not reached" not in proc.stdout, proc.stderr
    junk = leftovers(tmp_path)
    assert len(junk) == 1 and junk[0].startswith(".step_000008.pt.") and junk[0].endswith(".tmp")
    size = (tmp_path / junk[0]).stat().st_size
    full = (tmp_path / "step_000004.pt").stat().st_size
    assert (
        (size < full) if point == "mid-write" else (size == full)
    )  # half, or all of it, never renamed
    path, meta = find_latest(tmp_path)
    assert (
        meta["step"] == 4 and load_train_state(path, torch.device("cpu"))["x"].sum().item() == 0.0
    )
    assert json.loads((tmp_path / "events.jsonl").read_text())["fault"] == point
    leftovers(tmp_path, remove=True)
    assert leftovers(tmp_path) == []


@pytest.mark.timeout(30)
def test_check_same_run_refuses_another_model_or_world_size(tmp_path):
    model = torch.nn.Linear(2, 2)
    sig = model_signature(model)
    meta = {"model": sig, "world_size": 4}
    check_same_run(meta, sig, 4, tmp_path)
    with pytest.raises(LessonError, match="another model"):
        check_same_run(meta, model_signature(torch.nn.Linear(2, 3)), 4, tmp_path)
    with pytest.raises(LessonError, match="written by 4 ranks"):
        check_same_run(meta, sig, 2, tmp_path)


@pytest.mark.timeout(30)
def test_parse_faults_rejects_what_cannot_happen():
    every4 = lambda s: s % 4 == 0  # noqa: E731
    assert parse_faults(["exit@7:1", "mid-write@8"], 18, 2, every4, 2)[1].rank == 0
    for specs, restarts, message in [
        (["exit@19:1"], 2, "beyond the run"),
        (["exit@7:2"], 2, "does not exist"),
        (["mid-write@7"], 2, "checkpoint steps"),
        (["boom@7"], 2, "KIND must be"),
        (["exit@7:1", "exit@9:1"], 1, "--max-restarts >= 2"),
    ]:
        with pytest.raises(LessonError, match=message):
            parse_faults(specs, 18, 2, every4, restarts)


@pytest.mark.timeout(30)
def test_timeline_from_events():
    ev = [{"t": 0.0, "attempt": 0, "rank": 0, "kind": "start"}]
    ev += [
        {"t": 1.0 + s, "attempt": 0, "rank": 0, "kind": "step", "step": s, "loss": 1.0}
        for s in range(1, 7)
    ]
    ev += [
        {"t": 5.1, "attempt": 0, "rank": 0, "kind": "save", "step": 4},
        {"t": 7.5, "attempt": 0, "rank": 1, "kind": "fault", "fault": "exit", "step": 7},
        {"t": 10.0, "attempt": 1, "rank": 0, "kind": "start"},
        {"t": 11.0, "attempt": 1, "rank": 0, "kind": "resume", "step": 4, "ignored": []},
    ]
    ev += [
        {"t": 11.0 + s, "attempt": 1, "rank": 0, "kind": "step", "step": s, "loss": 1.0}
        for s in range(5, 9)
    ]
    tl = timeline(ev)
    assert tl["steps_redone"] == [[5, 6]]
    assert tl["restart_s"] == [16.0 - 7.5] and tl["lost_work_s"] == [7.5 - 5.1]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_inf_parameter_fails_the_equality_claims(bad):
    """Python's max(worst, nan) keeps the old value: the difference must come back NaN wherever the NaN is."""
    from common.checkpoint.train_state import max_diff_over_ranks

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    same = [p.detach().clone() for p in model.parameters()]
    assert max_diff_over_ranks(model, same, DistInfo()) == 0.0
    for i in range(len(same)):  # the bad value in each position, a real difference elsewhere
        other = [p.clone() + 0.5 for p in same]
        other[i][0] = bad
        assert not np.isfinite(max_diff_over_ranks(model, other, DistInfo())), (
            i
        )  # NaN or inf: the claim fails
