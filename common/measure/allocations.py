"""Bytes allocated inside a block, at named points and at their peak, on a CPU as on a GPU (lesson 14).

`torch.cuda.max_memory_allocated` exists on a GPU only. The profiler records every allocation and free on any
device when asked (`torch.profiler.profile(profile_memory=True)`): each is a `[memory]` event of its chrome trace
whose "Total Allocated" is what that device's allocator holds, counted from the profiler's start. So:

    with allocations(device) as trace:
        out = model(x)
        trace.mark("after forward")        # bytes allocated since the block began, and not yet freed
        out.sum().backward()
    trace.at["after forward"], trace.peak  # integers, in bytes, the same on every run of the same program

What was allocated before the block is not counted: the numbers are what the block added (the peak too; the
profiler's "Total Allocated" also carries blocks still alive from an earlier profiled block, so it is read from
the level just before the block's first event). Every thread's allocations count (gloo's buffers included).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["AllocationTrace", "allocations"]

_MARK = "allocations.mark:"
_DEVICE_TYPE = {"cpu": 0, "cuda": 1}  # the profiler's "Device Type" of a [memory] event


@dataclass
class AllocationTrace:
    """What `allocations` saw: `at` {mark: bytes held then}, `peak` (the most held at once), `end` (at the end)."""

    at: dict = field(default_factory=dict)
    peak: int = 0
    end: int = 0
    _marks: list = field(default_factory=list, repr=False)

    def mark(self, name: str) -> None:
        """Name this point of the block; `at[name]` is filled in when the block ends."""
        with record_function(_MARK + name):
            self._marks.append(name)

    def _read(self, events: list[dict], device_type: int) -> None:
        memory = sorted(
            (e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"])
            for e in events
            if e.get("name") == "[memory]" and e["args"].get("Device Type") == device_type
        )
        # "Total Allocated" also counts live blocks allocated in earlier profiled blocks: start from there
        start = memory[0][1] - memory[0][2] if memory else 0
        memory = [(ts, total - start) for ts, total, _ in memory]
        marks = {
            e["name"][len(_MARK) :]: e["ts"] for e in events if e.get("name", "").startswith(_MARK)
        }
        self.peak = max((held for _, held in memory), default=0)
        self.end = memory[-1][1] if memory else 0
        for name in self._marks:
            before = [held for ts, held in memory if ts <= marks[name]]
            self.at[name] = before[-1] if before else 0


@contextmanager
def allocations(device: torch.device | str = "cpu") -> Iterator[AllocationTrace]:
    """Trace the allocations on `device` inside the block (a profiler with profile_memory=True)."""
    device = torch.device(device)
    trace = AllocationTrace()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        yield trace
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    trace._read(events, _DEVICE_TYPE.get(device.type, 0))
