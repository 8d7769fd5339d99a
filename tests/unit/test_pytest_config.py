"""The test session's own hygiene: the fast subset ends with no warning a newcomer would take for their mistake.

- pyproject.toml ignores two DeprecationWarnings that torch raises inside its own import of
  `torch.distributed.optim` (66 `torch.jit.script` calls), and nothing else;
- tests/conftest.py freezes what collection imported, so that an xdist worker's last garbage collections are
  short enough that execnet never interrupts it (the KeyboardInterrupt inside hypothesis' gc callback);
- the tensor-parallel picture hands matplotlib a numpy array, not a tensor (numpy 2's `__array__` warning).
"""

from __future__ import annotations

import gc
import warnings
from pathlib import Path

import matplotlib
import pytest
import tomllib
import torch
from _pytest.config import parse_warning_filter

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parents[2]
TORCH_JIT_SCRIPT = (
    "`torch.jit.script` is deprecated. Please switch to `torch.compile` or `torch.export`."
)
TORCH_JIT_INTERFACE = "`torch.jit.interface` is deprecated. Please use `torch.compile` instead."


def ini_filters() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["pytest"]["ini_options"].get("filterwarnings", [])


def shown(message: str, category: type[Warning], module: str) -> bool:
    """Whether a warning raised by `module` gets through the ini filters (as pytest applies them)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for line in ini_filters():
            warnings.filterwarnings(*parse_warning_filter(line, escape=False))
        warnings.warn_explicit(
            message, category, filename=f"{module.replace('.', '/')}.py", lineno=1, module=module
        )
    return len(caught) == 1


def test_torch_jit_deprecations_from_torch_are_ignored():
    assert not shown(TORCH_JIT_SCRIPT, DeprecationWarning, "torch.jit._script")
    assert not shown(TORCH_JIT_INTERFACE, DeprecationWarning, "torch.jit._script")


@pytest.mark.parametrize(
    "message, category, module",
    [
        (
            TORCH_JIT_SCRIPT,
            DeprecationWarning,
            "common.sharding.zero",
        ),  # our code calling torch.jit would show
        (TORCH_JIT_SCRIPT, UserWarning, "torch.jit._script"),
        (
            "`torch.distributed.nn.functional.all_reduce` is deprecated",
            DeprecationWarning,
            "torch.distributed.nn",
        ),
        (
            "torch.distributed.launch is deprecated",
            FutureWarning,
            "torch.distributed.launch",
        ),  # lesson 03 shows it
        (
            "No device id is provided via `init_process_group` or `barrier`",
            UserWarning,
            "torch.distributed.distributed_c10d",
        ),
    ],
)
def test_every_other_warning_is_still_shown(message, category, module):
    assert shown(message, category, module), (
        f"pyproject.toml's filterwarnings hide {message!r} from {module}"
    )


def test_collection_froze_the_objects_it_imported():
    """Without the freeze a worker's final gc.collect() walked ~530,000 objects (3-4 s each on a busy 2-core
    machine); execnet interrupts a worker still busy 5 s after the end of the session."""
    assert gc.get_freeze_count() > 100_000, (
        "tests/conftest.py's pytest_collection_finish no longer freezes"
    )


def test_the_tensor_parallel_picture_gives_matplotlib_arrays():
    from common.plots.parallel import plot_tp_shards

    torch.manual_seed(0)
    w1, w2, h = torch.randn(8, 2), torch.randn(2, 8), torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter(
            "error", DeprecationWarning
        )  # numpy 2: a tensor's __array__ takes no `copy`
        fig = plot_tp_shards(
            w1, w2, list(w1.chunk(2, 0)), list(w2.chunk(2, 1)), h, list(h.chunk(2, 1))
        )
    assert len(fig.axes) == 3
    matplotlib.pyplot.close(fig)
