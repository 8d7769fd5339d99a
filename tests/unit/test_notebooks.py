"""Each notebook ends with the lines a reader copies into their own script, and those lines are the lesson's.

The last cell of notebooks/NN_x.ipynb is markdown headed `## Lines to copy`: it names the file the lines come
from (`minimal/NN_x.py` or `lessons/NN_x.py`) and holds one fenced code block. Every code line of the block is
a line of that file (a trailing `# comment` and the indentation aside), so the quote cannot rot.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
HEADING = "## Lines to copy"


def code(line: str) -> str:
    """A line without its trailing comment, its whitespace collapsed ("" for a comment or a blank line)."""
    line = re.sub(r"(^|\s)#(\s.*)?$", "", line)
    return " ".join(line.split())


def last_cell(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))["cells"][-1]


def lines_to_copy(cell: dict) -> tuple[str, list[str]]:
    """(the file the cell quotes, the code lines of its one fenced block)."""
    text = "".join(cell["source"])
    blocks = re.findall(r"```(?:python|bash)\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "one ```python (or ```bash) block"
    source = re.search(r"`((?:minimal|lessons)/\d\d_\w+\.py)`", text)
    assert source, "the cell names the file its lines come from"
    return source.group(1), [c for c in map(code, blocks[0].splitlines()) if c]


def test_there_is_one_notebook_per_lesson():
    assert [p.stem for p in NOTEBOOKS] == sorted(
        p.stem for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py")
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_ends_with_the_lines_to_copy_from_its_lesson(path):
    cell = last_cell(path)
    assert cell["cell_type"] == "markdown" and "".join(cell["source"]).startswith(HEADING), (
        f"{path.name}: the last cell is a markdown cell starting with {HEADING!r}"
    )
    source, lines = lines_to_copy(cell)
    assert Path(source).stem == path.stem, f"{path.name} quotes {source}, not its own lesson"
    assert len(lines) >= 2, f"{path.name}: at least 2 lines to copy"
    known = {code(line) for line in (ROOT / source).read_text(encoding="utf-8").splitlines()}
    missing = [line for line in lines if not any(line in k for k in known)]
    assert missing == [], f"{path.name}: lines that {source} does not have: {missing}"


def test_notebook_13_shows_the_fully_shard_lines():
    """Lesson 13 wraps with common's `shard_blocks_then_root`; the cell spells out its fully_shard lines, each
    block, then the root, and they are common/sharding/fsdp.py's."""
    cell = last_cell(ROOT / "notebooks" / "13_sharded_data_parallel.ipynb")
    _, lines = lines_to_copy(cell)
    assert any("shard_blocks_then_root(" in line for line in lines)
    recipe = re.findall(r"`(fully_shard\((?:block|model), [^`]*\))`", "".join(cell["source"]))
    fsdp = (ROOT / "common" / "sharding" / "fsdp.py").read_text(encoding="utf-8").splitlines()
    assert len(recipe) >= 2, "each block, then the root"
    assert all(any(r in code(line) for line in fsdp) for r in recipe), recipe


def test_a_quote_that_drifted_from_its_lesson_fails(tmp_path):
    """The check itself: a quoted line the lesson does not have is reported."""
    cell = last_cell(ROOT / "notebooks" / "03_ddp.ipynb")
    cell = {
        **cell,
        "source": [
            "".join(cell["source"]).replace("sampler.set_epoch(epoch)", "sampler.set_epoch(0)")
        ],
    }
    source, lines = lines_to_copy(cell)
    known = {code(line) for line in (ROOT / source).read_text(encoding="utf-8").splitlines()}
    assert [line for line in lines if not any(line in k for k in known)] == ["sampler.set_epoch(0)"]
