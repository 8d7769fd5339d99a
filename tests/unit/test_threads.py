"""A plain `python lessons/NN_x.py` computes on one thread, as torchrun and the notebooks do, unless told otherwise:
with one thread per core lesson 01 printed other losses than its notebook (and ran slower on 2 shared cores)."""

import torch

from common.harness.process_exit import one_thread_unless_told


def test_unset_means_one_thread_said_once_and_inherited(monkeypatch, capsys):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    try:
        torch.set_num_threads(2)
        one_thread_unless_told()
        assert torch.get_num_threads() == 1
        assert capsys.readouterr().out.startswith(
            "note: OMP_NUM_THREADS is unset: 1 compute thread"
        )
        import os

        assert os.environ["OMP_NUM_THREADS"] == "1"  # what mp.spawn's children start with
    finally:
        torch.set_num_threads(before)


def test_a_set_variable_is_left_alone(monkeypatch, capsys):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    try:
        torch.set_num_threads(2)
        one_thread_unless_told()
        assert torch.get_num_threads() == 2 and capsys.readouterr().out == ""
    finally:
        torch.set_num_threads(before)


def test_only_rank_0_says_it(monkeypatch, capsys):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("RANK", "1")
    try:
        one_thread_unless_told()
        assert torch.get_num_threads() == 1 and capsys.readouterr().out == ""
    finally:
        torch.set_num_threads(before)
