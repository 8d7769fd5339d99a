"""Lesson 12's exhibits whose fix claims identical replicas, launched with a NaN in rank 1's replica while they
compare (tests/_nan_on_rank1.py): the claim does not hold and the lesson exits 1. Lessons 03, 05 and 07 have
the same test in their own files; the helper itself is tested in tests/unit/test_differences.py."""

from __future__ import annotations

import math

import pytest

from tests._lessons import DEV
from tests._nan_on_rank1 import failing_claims, launch_with_nan_on_rank1

EXHIBITS = ["rank_skips_step", "uneven_batches_without_join", "nan_spreads_to_all_ranks"]


@pytest.mark.timeout(360)
@pytest.mark.parametrize("exhibit", EXHIBITS)
def test_a_nan_on_rank_1_alone_fails_the_fixed_replicas_claim(exhibit):
    run = launch_with_nan_on_rank1("12_troubleshooting", ["--show", exhibit, *DEV])
    assert run.returncode == 1, run.stdout + run.stderr
    failing = failing_claims(run)
    name = f"{exhibit}_fixed_replicas_identical"
    assert list(failing) == [name] and math.isnan(failing[name]), failing


def test_every_exhibit_that_compares_replicas_is_launched_above():
    import inspect

    from common.exhibits.frame import load_exhibits

    compares = [
        n
        for n, ex in load_exhibits().items()
        if "max_param_diff_across_ranks" in inspect.getsource(ex.fn)
    ]
    assert sorted(compares) == sorted(EXHIBITS)
