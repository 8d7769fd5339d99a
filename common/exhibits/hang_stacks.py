"""A real, bounded hang and the stack of every rank (notebook 12, "How to diagnose a hang").

    hang = start_hang(dump_after_s=3)                  # torchrun, 2 ranks: rank 0 waits in an all_reduce
    for rank, pid in hang.pids.items():
        print(py_spy_dump(pid))                        # `py-spy dump --pid PID`: Python stacks, no restart
    dumps = hang.faulthandler_dumps()                  # what each rank printed itself after 3 s
    hang.stop()                                        # kill the launch (its timeout would end it later)

`py-spy` (https://github.com/benfred/py-spy, `pip install py-spy`) reads a running process's stacks from outside;
`faulthandler.dump_traceback_later` (https://docs.python.org/3/library/faulthandler.html) makes each process
print its own stack after a delay, which also works where ptrace is not allowed (some containers, clusters).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.run.processes import REPO_ROOT

__all__ = ["Hang", "start_hang", "py_spy_dump", "normalise_stack"]


@dataclass
class Hang:
    proc: subprocess.Popen
    log: Path
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid

    def output(self) -> str:
        return self.log.read_text()

    def faulthandler_dumps(self, wait_s: float = 60) -> dict[int, str]:
        """rank -> the stack that rank's faulthandler wrote (waits until both files are written)."""
        files = {r: self.log.parent / f"faulthandler_rank{r}.txt" for r in (0, 1)}
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not all(
            f.exists() and "most recent call first" in f.read_text() for f in files.values()
        ):
            time.sleep(0.1)
        time.sleep(0.2)  # the rest of the frames
        return {r: f.read_text() if f.exists() else "" for r, f in files.items()}

    def stop(self) -> str:
        """Kill every rank, then the launch (the ranks would otherwise wait until the collective timeout).

        The ranks first: torchrun starts each worker in a session of its own, so killing the launcher's process
        group would leave them running.
        """
        for pid in self.pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        return self.output()


def start_hang(dump_after_s: float = 3.0, timeout_s: float = 120.0, wait_s: float = 60.0) -> Hang:
    """Launch `common.exhibits.worker hang` on 2 ranks and return once both have printed their PIDs."""
    log = Path(tempfile.mkdtemp()) / "hang.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "common.exhibits.worker",
        "hang",
        str(dump_after_s),
        str(timeout_s),
        str(log.parent),
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        cwd=REPO_ROOT,
        env=env,
        start_new_session=True,
    )
    hang = Hang(proc, log)
    deadline = time.monotonic() + wait_s
    while len(hang.pids) < 2 and time.monotonic() < deadline:
        # not anchored to line starts: two ranks' prints can run together on one line ("rank 1 pid 7rank 0 pid 6")
        hang.pids = {int(r): int(p) for r, p in re.findall(r"rank (\d) pid (\d+)", hang.output())}
        time.sleep(0.1)
    if len(hang.pids) < 2:
        hang.stop()
        raise RuntimeError(f"the hang did not start:\n{hang.output()}")
    time.sleep(0.5)  # both are inside train_step now
    return hang


def py_spy_dump(pid: int) -> str:
    """`py-spy dump --pid PID` (the py-spy next to this Python, else on PATH)."""
    exe = Path(sys.executable).with_name("py-spy")
    exe = str(exe) if exe.exists() else shutil.which("py-spy") or "py-spy"
    p = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    return p.stdout + p.stderr


def normalise_stack(text: str) -> str:
    """Keep the frames (function, file, line) of a py-spy or faulthandler dump; drop PIDs, addresses, paths."""
    out = []
    for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines():  # py-spy colours its output
        line = re.sub(r"^(Process|Thread) (0x[0-9a-f]+|\d+)\b.*", r"\1 ...", line)
        line = re.sub(r"\(idle\)|\(active\)|\(active\+gil\)", "", line)
        line = re.sub(r"/\S*?/site-packages/", "", line).replace(str(REPO_ROOT) + "/", "")
        if line.startswith("Python v") or not line.strip():
            continue
        out.append(line.rstrip())
    return "\n".join(out)
