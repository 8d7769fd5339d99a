"""Small helpers the graders share: reading the ranks' answers and describing numbers."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from common.measure.differences import max_abs_diff
from exercises._ranks import RankError, RankHung

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce",
    "broadcast",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "all_reduce_coalesced",
    "all_gather_coalesced",
    "_all_gather_base",
    "_reduce_scatter_base",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)


def rank_failures(answers: Sequence) -> list[str]:
    """One problem per rank that raised or gave no answer."""
    out = []
    for rank, answer in enumerate(answers):
        if isinstance(answer, (RankError, RankHung)):
            out.append(f"rank {rank}: {answer}")
    return out


def short(values: Sequence[float], n: int = 4) -> str:
    """[1.0, 2.0, 3.0, 4.0, ...] with at most `n` numbers, rounded for reading."""
    head = ", ".join(f"{v:.4g}" for v in list(values)[:n])
    return f"[{head}{', ...' if len(values) > n else ''}]"


def answer_diff(a, b) -> float:
    """max |a - b| between a learner's answer and the expected one (tensors, lists or numbers, compared in
    float64): `common.measure.differences.max_abs_diff`, NaN when either holds a NaN or an inf anywhere; inf when
    the shapes differ (an answer of the wrong shape is as wrong as it gets)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape:
        return math.inf
    d = max_abs_diff(a, b)
    return math.nan if math.isinf(d) else d


def close(a, b, tol: float) -> bool:
    """Equal within `tol`; False on NaN, inf or a shape mismatch."""
    d = answer_diff(a, b)
    return not math.isnan(d) and d <= tol


@contextlib.contextmanager
def functions_replaced(replacements: dict, modules: Sequence = ()) -> Iterator[None]:
    """Inside the block every name bound to a function in `replacements` (by identity) is bound to its
    replacement: in torch.distributed, in torch.distributed.distributed_c10d and in each of `modules` (a
    learner's module that did `from torch.distributed import all_reduce` holds its own binding)."""
    by_id = {id(old): new for old, new in replacements.items()}
    saved = []
    for module in [dist, c10d, *modules]:
        for name, value in list(vars(module).items()):
            if id(value) in by_id and callable(value):
                saved.append((module, name, value))
                setattr(module, name, by_id[id(value)])
    try:
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


@contextlib.contextmanager
def collectives_forbidden(reason: str, modules: Sequence = ()) -> Iterator[None]:
    """Inside the block every collective of torch.distributed (and its *_object functions) raises, naming
    `reason`, however it is reached: dist.NAME, distributed_c10d.NAME, or a name a learner's module bound at
    import."""

    def refuse(name: str):
        def call(*args, **kwargs):
            raise RuntimeError(f"dist.{name} called: {reason}")

        return call

    refused = {getattr(c10d, name): refuse(name) for name in COLLECTIVES if hasattr(c10d, name)}
    with functions_replaced(refused, modules):
        yield


@contextlib.contextmanager
def collectives_counted(count: list[int], modules: Sequence = ()) -> Iterator[None]:
    """Inside the block every call of a torch.distributed collective adds 1 to count[0] (however it is
    reached, as in `functions_replaced`): ranks whose counts differ did not call the same collectives."""

    def counting(original):
        @functools.wraps(original)  # its signature too: a watcher reads async_op through it
        def call(*args, **kwargs):
            count[0] += 1
            return original(*args, **kwargs)

        return call

    originals = [getattr(c10d, name) for name in COLLECTIVES if hasattr(c10d, name)]
    counted = {original: counting(original) for original in originals}
    with functions_replaced(counted, modules):
        yield


class _WatchedWork:
    """A collective's async work that records in `log` when it is waited on (`wait`, or its future taken);
    everything else goes to the real work."""

    def __init__(self, work, index: int, log: list):
        self._work, self._index, self._log = work, index, log

    def wait(self, *args, **kwargs):
        self._log.append(("waited", self._index))
        return self._work.wait(*args, **kwargs)

    def get_future(
        self, *args, **kwargs
    ):  # torch.futures.wait_all(...) and .then() reach the work this way
        self._log.append(("waited", self._index))
        return self._work.get_future(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _is_async(original, args, kwargs) -> bool:
    try:
        return bool(
            inspect.signature(original).bind(*args, **kwargs).arguments.get("async_op", False)
        )
    except (TypeError, ValueError):
        return bool(kwargs.get("async_op", False))


@contextlib.contextmanager
def works_watched(log: list, modules: Sequence = ()) -> Iterator[None]:
    """Inside the block every collective called with async_op=True appends ("launched", i, name) to `log` and
    returns a work whose wait appends ("waited", i): `unwaited(log)` then names the works nobody waited on."""

    def watching(original):
        @functools.wraps(original)
        def call(*args, **kwargs):
            work = original(*args, **kwargs)
            if work is None or not _is_async(original, args, kwargs):
                return work
            index = sum(1 for e in log if e[0] == "launched")
            log.append(("launched", index, original.__name__))
            return _WatchedWork(work, index, log)

        return call

    originals = [getattr(c10d, name) for name in COLLECTIVES if hasattr(c10d, name)]
    watched = {original: watching(original) for original in originals}
    with functions_replaced(watched, modules):
        yield


def unwaited(log: list) -> list[str]:
    """The names of the async works in `log` (from `works_watched`) that were never waited on."""
    waited = {e[1] for e in log if e[0] == "waited"}
    return [e[2] for e in log if e[0] == "launched" and e[1] not in waited]


# A grader's message is English (the wrong-answer tests match it); below each one `python -m exercises` prints
# one Chinese line: what kind of mistake the message names (the first pattern that matches) and where the
# exercise's contract and hint are in Chinese.
ZH_KINDS = (
    (
        r"skipped a collective",
        "有的 rank 少调用了一次集合通信，其他 rank 一直在里面等：每个 rank 必须按同样的顺序调用同样的"
        "集合通信，检查有没有放在依赖 rank 或数据的 if 里的集合通信",
    ),
    (
        r"NotImplementedError|not solved yet",
        "还没有实现：把函数里的 raise NotImplementedError 换成你的代码",
    ),
    (
        r"\bhung\b|did not (return|finish)|[Tt]imed out",
        "有 rank 没有在超时内返回（卡住了）：多半是各 rank 的集合通信没有一一配对",
    ),
    (r"dist\.\w+ called", "这里不许调用集合通信：英文说明了原因，要用点对点消息或本地计算自己实现"),
    (r"\braised\b", "你的代码抛出了异常：英文是异常的第一行和抛出它的那一行代码"),
    (
        r"expected|yours|differs|instead of|should|bit for bit|not equal",
        "结果与参考实现不同：英文先给出条件，再给出你的结果和期望的结果，冒号后面是提示",
    ),
)


def zh_line(exercise: str, lesson: str, problem: str) -> str:
    """One Chinese line for a grader's English `problem`: the kind of mistake, and the guide to read."""
    kind = next(
        (zh for pattern, zh in ZH_KINDS if re.search(pattern, problem)),
        "未通过：英文说明了哪里不对",
    )
    guides = sorted(
        (Path(__file__).resolve().parents[2] / "docs" / "zh" / "lessons").glob(f"{lesson}_*.md")
    )
    where = f"docs/zh/lessons/{guides[0].name}" if guides else f"第 {lesson} 课的中文导读"
    return f"（中文）{kind}。练习 {exercise} 的要求和提示见 {where}「练习与最小脚本」一节。"
