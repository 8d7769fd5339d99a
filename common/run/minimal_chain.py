"""The chain of minimal scripts: each one shown as a diff from its nearest earlier sibling, or whole.

A minimal script's base is the earlier script (lower lesson number) whose unified diff to it changes the fewest
lines; when even that diff changes more than `MAX_CHANGED` lines, the script has no base and is shown whole (a
diff longer than the script explains nothing). Nothing here is a table: adding minimal/NN_x.py places it in the
chain. Plain Python (difflib): the website imports it without torch or jupyter.
"""

from __future__ import annotations

import difflib
from pathlib import Path

MINIMAL = Path(__file__).resolve().parents[2] / "minimal"
# Added + removed lines: about 60; the 01 -> 03 diff (DDP, 70 lines) is the one every reader should see.
MAX_CHANGED = 70


def minimal_scripts(folder: Path = MINIMAL) -> dict[str, Path]:
    """Lesson number ("03") -> minimal/NN_*.py, for every minimal script in `folder`."""
    return {p.name[:2]: p for p in sorted(folder.glob("[0-9][0-9]_*.py"))}


def minimal_path(number: str, folder: Path = MINIMAL) -> Path:
    """minimal/NN_*.py for lesson number "NN" (or "NN_x"). Raises FileNotFoundError when there is none."""
    found = minimal_scripts(folder).get(number[:2])
    if found is None:
        raise FileNotFoundError(f"no minimal/{number[:2]}_*.py")
    return found


def changed_lines(old: str, new: str) -> int:
    """Lines added plus lines removed by the unified diff from `old` to `new`."""
    diff = difflib.unified_diff(old.splitlines(), new.splitlines(), n=0, lineterm="")
    return sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))


def minimal_base(number: str, folder: Path = MINIMAL) -> str | None:
    """The lesson number of the script that `number`'s is the smallest diff from, among earlier ones, or None
    when every such diff changes more than MAX_CHANGED lines (then the script is shown whole)."""
    scripts = minimal_scripts(folder)
    new = minimal_path(number, folder).read_text()
    best = min(
        ((changed_lines(p.read_text(), new), n) for n, p in scripts.items() if n < number[:2]),
        default=None,
    )
    return best[1] if best is not None and best[0] <= MAX_CHANGED else None


def minimal_diff(lesson: str, context: int = 1, folder: Path = MINIMAL) -> str:
    """What a notebook prints for lesson `lesson`'s minimal script ("03" or "03_ddp"), read from the files
    now (so it can never show stale code): the unified diff from its base, or the whole script under a header
    line when it has none."""
    new = minimal_path(lesson, folder)
    base = minimal_base(lesson, folder)
    if base is None:
        text = new.read_text()
        return f"# minimal/{new.name}, the whole script ({len(text.splitlines())} lines)\n" + text
    old = minimal_path(base, folder)
    lines = difflib.unified_diff(
        old.read_text().splitlines(),
        new.read_text().splitlines(),
        f"minimal/{old.name}",
        f"minimal/{new.name}",
        n=context,
        lineterm="",
    )
    return "\n".join(lines)
