"""The READMEs and docs cannot drift: the symptom index names lesson 12's exhibits, and the Chinese README's
lesson map runs the same commands as the English one.

What the tests read (plain markdown, no markers):
- a *lesson-map table*: any table whose rows start with a two-digit lesson number (`| 03 | ... |`) and name a
  lesson file; the commands are the backticked spans in that row that mention `lessons/NN_x.py`;
- the *symptom index*: docs/symptoms.md and docs/zh/symptoms.md; the table under `## Reproduced here`
  (`## 本机复现`) has the exhibit's name in backticks in its third column, and a section `## GPU only (NCCL)`
  (`## 仅限 GPU（NCCL）`) quotes NCCL's own texts, marked as not reproduced.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from common.exhibits import load_exhibits

ROOT = Path(__file__).resolve().parents[2]
LESSON_FILE = re.compile(r"lessons/\d\d_\w+\.py")


def read(name: str) -> str:
    path = ROOT / name
    if not path.is_file():
        pytest.fail(f"{name} is missing")
    return path.read_text(encoding="utf-8")


def table_rows(text: str) -> list[list[str]]:
    """Every markdown table row as its stripped cells (separator rows left out)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("|") and line.endswith("|") and not re.fullmatch(r"\|[\s:|-]+\|", line):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line[1:-1])])
    return rows


def lesson_map(text: str) -> dict[str, list[str]]:
    """{"03": ["torchrun ... lessons/03_ddp.py ..."], ...} from the lesson-map table(s)."""
    out: dict[str, list[str]] = {}
    for cells in table_rows(text):
        if re.fullmatch(r"\d\d", cells[0]) and LESSON_FILE.search(" ".join(cells)):  # not a table of numbers
            spans = re.findall(r"`([^`]+)`", " | ".join(cells[1:]))
            out[cells[0]] = [s for s in spans if LESSON_FILE.search(s)]
    return out


def section(text: str, heading: str) -> str:
    """The text from `heading` to the next heading of the same or a higher level."""
    m = re.search(rf"^{re.escape(heading)}\s*$(.*?)(?=^#{{1,2}} |\Z)", text, re.M | re.S)
    assert m, f"no heading {heading!r}"
    return m.group(1)


def index_exhibits(text: str, heading: str) -> list[str]:
    rows = [c for c in table_rows(section(text, heading)) if len(c) >= 3]
    names = [re.findall(r"`([a-z0-9_]+)`", c[2]) for c in rows[1:]]  # rows[0] is the header
    assert all(len(n) == 1 for n in names), f"each row's third column names one exhibit: {names}"
    return [n[0] for n in names]


SYMPTOM_PAGES = (("docs/symptoms.md", "## Reproduced here", "## GPU only (NCCL): not reproduced here"),
                 ("docs/zh/symptoms.md", "## 本机复现", "## 仅限 GPU（NCCL）：本机未复现"))


def test_every_exhibit_is_in_the_symptom_index_and_every_row_exists():
    exhibits = set(load_exhibits())
    for name, heading, _ in SYMPTOM_PAGES:
        listed = index_exhibits(read(name), heading)
        assert sorted(set(listed) - exhibits) == [], f"{name}: rows naming no exhibit"
        assert sorted(exhibits - set(listed)) == [], f"{name}: exhibits missing from the index"
        assert len(listed) == len(set(listed)), f"{name}: an exhibit with two rows"


def test_symptom_index_pages_list_the_exhibits_in_the_same_order():
    en, zh = (index_exhibits(read(name), heading) for name, heading, _ in SYMPTOM_PAGES)
    assert zh == en


def test_english_symptom_table_is_the_generated_one():
    lesson = importlib.import_module("lessons.12_troubleshooting")
    assert section(read("docs/symptoms.md"), "## Reproduced here").strip().endswith(lesson.symptom_index())


def test_gpu_only_block_quotes_nccl_texts_and_says_it_is_not_reproduced():
    for name, _, heading in SYMPTOM_PAGES:
        block = section(read(name), heading)
        for text in ("Watchdog caught collective operation timeout: WorkNCCL(", "unhandled system error",
                     "Heartbeat monitor timed out!"):
            assert text in block, f"{name}: the GPU-only block lacks {text!r}"
        assert not re.search(r"`[a-z0-9_]+`", "".join(c[2] for c in table_rows(block)[1:] if len(c) > 3)), name


def test_chinese_lesson_map_matches_the_english_one():
    en, zh = lesson_map(read("README.md")), lesson_map(read("README.zh-CN.md"))
    assert en, "README.md has no lesson-map table (rows starting with | NN |)"
    assert zh == en


def test_chinese_readme_mentions_every_lesson_file_of_the_english_one():
    en, zh = set(LESSON_FILE.findall(read("README.md"))), set(LESSON_FILE.findall(read("README.zh-CN.md")))
    assert sorted(en - zh) == []


def test_lesson_files_named_in_the_readmes_exist():
    for name in ("README.md", "README.zh-CN.md"):
        missing = [f for f in set(LESSON_FILE.findall(read(name))) if not (ROOT / f).is_file()]
        assert missing == [], f"{name} names lesson files that do not exist: {missing}"
