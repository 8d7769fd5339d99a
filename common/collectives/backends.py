"""Which torch.distributed backend runs which operation on which device: the table of the PyTorch docs (lesson 02).

https://pytorch.org/docs/stable/distributed.html#backends (torch 2.x). True = supported, False = not, None = "?"
(MPI on CUDA depends on how MPI was built). NCCL moves CUDA tensors only, gloo CPU tensors (and some operations on
CUDA tensors), MPI exists only in builds of PyTorch from source. Lesson 02 prints the table and then runs most of
the column of the backend it got; its notebook prints the same table through `backend_table`.

The table is the docs', not a measurement: the docs mark all_to_all unsupported on gloo (CPU and GPU), yet gloo on
CPU runs `dist.all_to_all` and `dist.all_to_all_single` in torch 2.13 (checked by hand with 2 processes; lesson 02
does not run all_to_all, gather or scatter).
"""

from __future__ import annotations

__all__ = ["BACKEND_OPS", "BACKEND_SUPPORT", "backend_table"]

BACKEND_OPS = [
    "send",
    "recv",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "barrier",
]
BACKEND_SUPPORT: dict[tuple[str, str], dict[str, bool | None]] = {
    ("gloo", "cpu"): {**dict.fromkeys(BACKEND_OPS, True), "all_to_all": False},
    ("gloo", "cuda"): {
        **dict.fromkeys(BACKEND_OPS, True),
        "send": False,
        "recv": False,
        "all_to_all": False,
        "barrier": False,
    },
    ("mpi", "cpu"): {**dict.fromkeys(BACKEND_OPS, True), "reduce_scatter": False},
    ("mpi", "cuda"): {**dict.fromkeys(BACKEND_OPS, None), "reduce_scatter": False},
    ("nccl", "cpu"): dict.fromkeys(BACKEND_OPS, False),
    ("nccl", "cuda"): dict.fromkeys(BACKEND_OPS, True),
}


def backend_table(built: dict[str, bool] | None = None) -> list[str]:
    """The table as text lines (a header, one line per op); with `built` ({"gloo": True, "nccl": False, "mpi":
    False}, from `dist.is_*_available()`), a last line saying which backends this build of torch contains."""
    mark = {True: "yes", False: "no", None: "?"}
    cols = [(b, d) for b in ("gloo", "mpi", "nccl") for d in ("cpu", "cuda")]
    lines = [f"{'':>15}" + "".join(f"{b + '/' + d:>10}" for b, d in cols)]
    lines += [
        f"{op:>15}" + "".join(f"{mark[BACKEND_SUPPORT[c][op]]:>10}" for c in cols)
        for op in BACKEND_OPS
    ]
    if built is not None:
        lines.append(f"{'built here':>15}" + "".join(f"{mark[built[b]]:>10}" for b, _ in cols))
    return lines
