"""Which collective travelled in which group of a rank grid, and the bytes each rank sent (lesson 11).

`traffic_rows` turns a `CollectiveCount` (`common.measure.counters.count_collectives`, or
`common.measure.dtensor_counts.count_dtensor_collectives`) into one row per (collective, group): the buffer
handed to it (the bytes of the full tensor, the Psi of the cost formulas) and the bytes one rank sends under the
ring model (`common.measure.bandwidth.bus_bandwidth_factor`): an all-reduce sends 2 (n-1)/n of its buffer, an
all-gather or a reduce-scatter (n-1)/n, a send all of it, a recv nothing. The two are not the same thing.
"""

from __future__ import annotations

from common.measure.bandwidth import bus_bandwidth_factor
from common.measure.counters import CollectiveCount

__all__ = ["sent_per_rank", "traffic_rows", "merged"]


def sent_per_rank(op: str, n: int, nbytes: int) -> int:
    """Bytes one rank sends for `nbytes` handed to `op` in a group of n ranks, under the ring model."""
    if op in ("send", "recv"):
        return nbytes if op == "send" else 0
    return round(bus_bandwidth_factor(op, n) * nbytes)


def traffic_rows(counts: CollectiveCount, dim_of_op: dict, ranks_of_dim: dict) -> list[dict]:
    """Rows {op, dim, ranks, calls, bytes, sent, in_its_group} of one step's counts: `dim_of_op` names the grid
    dimension each op should travel in, `ranks_of_dim` this rank's group along each dimension. A row's ranks
    come from the process group the call really used; `in_its_group` says whether that is its dimension's."""
    rows = []
    for (op, ranks), n in sorted(counts.groups.items()):
        dim = dim_of_op[op]
        row = {"op": op, "dim": dim, "ranks": list(ranks), "calls": n, "bytes": counts.bytes[op]}
        row["sent"] = sent_per_rank(op, len(ranks), counts.bytes[op])
        row["in_its_group"] = list(ranks) == ranks_of_dim[dim]
        rows.append(row)
    return rows


def merged(*counts: CollectiveCount) -> CollectiveCount:
    """One count of several blocks (a forward and its backward): calls, bytes and groups added up."""
    total = CollectiveCount()
    for c in counts:
        for mine, theirs in (
            (total.calls, c.calls),
            (total.bytes, c.bytes),
            (total.groups, c.groups),
        ):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v
    return total
