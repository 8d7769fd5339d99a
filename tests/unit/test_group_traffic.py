"""common/measure/group_traffic.py: rows per (collective, group), the ring model's bytes sent, merged counts."""

from __future__ import annotations

from common.measure.counters import CollectiveCount
from common.measure.group_traffic import merged, sent_per_rank, traffic_rows


def test_sent_per_rank_follows_the_ring_model():
    assert sent_per_rank("all_reduce", 2, 1000) == 1000  # 2 (n-1)/n
    assert sent_per_rank("all_reduce", 4, 1000) == 1500
    assert sent_per_rank("all_gather", 4, 1000) == sent_per_rank("reduce_scatter", 4, 1000) == 750
    assert (sent_per_rank("send", 2, 64), sent_per_rank("recv", 2, 64)) == (64, 0)
    assert sent_per_rank("all_reduce", 1, 1000) == 0  # a group of one sends nothing


def test_rows_say_whether_each_call_stayed_in_its_dimensions_group():
    c = CollectiveCount(
        calls={"all_reduce": 2}, bytes={"all_reduce": 80}, groups={("all_reduce", (0, 2)): 2}
    )
    (row,) = traffic_rows(c, {"all_reduce": "dp"}, {"dp": [0, 2], "tp": [0, 1]})
    assert row == {
        "op": "all_reduce",
        "dim": "dp",
        "ranks": [0, 2],
        "calls": 2,
        "bytes": 80,
        "sent": 80,
        "in_its_group": True,
    }
    (row,) = traffic_rows(c, {"all_reduce": "tp"}, {"dp": [0, 2], "tp": [0, 1]})
    assert row["in_its_group"] is False


def test_merged_adds_calls_bytes_and_groups():
    a = CollectiveCount({"all_gather": 1}, {"all_gather": 8}, {("all_gather", (0, 1)): 1})
    b = CollectiveCount({"all_gather": 2}, {"all_gather": 16}, {("all_gather", (0, 1)): 2})
    m = merged(a, b)
    assert (m.calls, m.bytes, m.groups) == (
        {"all_gather": 3},
        {"all_gather": 24},
        {("all_gather", (0, 1)): 3},
    )
    assert a.calls == {"all_gather": 1}  # the inputs are left as they were
