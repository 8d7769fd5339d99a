"""The READMEs and docs cannot drift: the symptom index names lesson 12's exhibits, and the Chinese README's
lesson map runs the same commands as the English one.

What the tests read (plain markdown, no markers):
- a *lesson-map table*: any table whose rows start with a two-digit lesson number (`| 03 | ... |`) and name a
  lesson file; the commands are the backticked spans in that row that mention `lessons/NN_x.py`;
- the *symptom index*: docs/symptoms.md and docs/zh/symptoms.md; the table under `## Reproduced here`
  (`## 本机复现`) has the exhibit's name in backticks in its `exhibit` (`复现案例`) column, and a section `## GPU only (NCCL)`
  (`## 仅限 GPU（NCCL）`) quotes NCCL's own texts, marked as not reproduced.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import shlex
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest

from common.exhibits.frame import load_exhibits

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
        if re.fullmatch(r"\d\d", cells[0]) and LESSON_FILE.search(
            " ".join(cells)
        ):  # not a table of numbers
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
    column = next(i for i, h in enumerate(rows[0]) if h in ("exhibit", "复现案例"))
    names = [re.findall(r"`([a-z0-9_]+)`", c[column]) for c in rows[1:]]
    assert all(len(n) == 1 for n in names), f"each row's exhibit column names one exhibit: {names}"
    return [n[0] for n in names]


SYMPTOM_PAGES = (
    ("docs/symptoms.md", "## Reproduced here", "## GPU only (NCCL): not reproduced here"),
    ("docs/zh/symptoms.md", "## 本机复现", "## 仅限 GPU（NCCL）：本机未复现"),
)


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
    assert (
        section(read("docs/symptoms.md"), "## Reproduced here")
        .strip()
        .endswith(lesson.symptom_index())
    )


def test_gpu_only_block_quotes_nccl_texts_and_says_it_is_not_reproduced():
    for name, _, heading in SYMPTOM_PAGES:
        block = section(read(name), heading)
        for text in (
            "Watchdog caught collective operation timeout: WorkNCCL(",
            "unhandled system error",
            "Heartbeat monitor timed out!",
        ):
            assert text in block, f"{name}: the GPU-only block lacks {text!r}"
        assert not re.search(
            r"`[a-z0-9_]+`", "".join(c[2] for c in table_rows(block)[1:] if len(c) > 3)
        ), name


WINDOWS_PAGES = (
    ("docs/symptoms.md", "## Windows and builds without NCCL: not reproduced here"),
    ("docs/zh/symptoms.md", "## Windows 与不带 NCCL 的构建：本机未复现"),
)


def test_windows_block_quotes_torchs_own_text_and_default():
    """The Windows rows say what torch's USE_LIBUV default is; the NCCL text they point at is an exhibit's."""
    torch_dir = Path(importlib.util.find_spec("torch").origin).parent / "distributed"
    agent_store = (torch_dir / "elastic" / "utils" / "distributed.py").read_text(encoding="utf-8")
    assert (
        'os.environ.get("USE_LIBUV", "1") == "1"' in agent_store
    )  # torchrun's store asks for libuv
    for name, heading in WINDOWS_PAGES:
        block = section(read(name), heading)
        quoted = re.findall(r"^\| `([^`]+)` \|", block, re.M)
        assert any("USE_LIBUV=0" in q for q in quoted) and "WSL2" in block, name
        assert "`nccl_not_built_in`" in block and "nccl_not_built_in" in load_exhibits(), name


def test_chinese_lesson_map_matches_the_english_one():
    en, zh = lesson_map(read("README.md")), lesson_map(read("README.zh-CN.md"))
    assert en, "README.md has no lesson-map table (rows starting with | NN |)"
    assert zh == en


def test_chinese_readme_mentions_every_lesson_file_of_the_english_one():
    en, zh = (
        set(LESSON_FILE.findall(read("README.md"))),
        set(LESSON_FILE.findall(read("README.zh-CN.md"))),
    )
    assert sorted(en - zh) == []


def test_lesson_files_named_in_the_readmes_exist():
    for name in ("README.md", "README.zh-CN.md"):
        missing = [f for f in set(LESSON_FILE.findall(read(name))) if not (ROOT / f).is_file()]
        assert missing == [], f"{name} names lesson files that do not exist: {missing}"


# --- The README as a map, its pages under docs/ and their Chinese counterparts ---

README_MAX_WORDS = 1500
# Links into paths another branch was still creating were once tolerated here; every such path has landed, so
# a missing target fails.
PENDING: tuple[str, ...] = ()
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def markdown_pages() -> list[Path]:
    return sorted([*ROOT.glob("README*.md"), *(ROOT / "docs").rglob("*.md")])


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (CJK kept), spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # a `# comment` in a code block is no heading
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def local_links(page: Path) -> list[tuple[str, str]]:
    """[(target path relative to the root, anchor)] for every relative link on the page."""
    out = []
    for target in LINK.findall(
        re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    ):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page.resolve()
        out.append((resolved.relative_to(ROOT).as_posix() if path else rel(page), anchor))
    return out


def pending(target: str) -> bool:
    """A link into a path another branch creates, tolerated while that path does not exist yet."""
    return any(target.startswith(p) and not (ROOT / p).exists() for p in PENDING)


def test_readme_is_a_map_of_at_most_1500_words():
    words = len(read("README.md").split())  # what `wc -w README.md` counts
    assert words <= README_MAX_WORDS, (
        f"README.md has {words} words; move detail to a page under docs/"
    )


def test_readmes_have_start_here_with_the_routes_by_goal():
    for name, heading in (("README.md", "## Start here"), ("README.zh-CN.md", "## 从这里开始")):
        routes = re.findall(r"\d\d(?: -> \d\d)+", section(read(name), heading))
        for route in ("01 -> 02 -> 03 -> 05 -> 07", "08 -> 13 -> 14 -> 10 -> 11 -> 09"):
            assert any(r.startswith(route) for r in routes), f"{name}: no route {route}"


def test_lesson_table_has_one_row_per_lesson_running_that_lesson():
    lessons = sorted(p.stem for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py"))
    table = lesson_map(read("README.md"))
    assert sorted(table) == [s[:2] for s in lessons], "one lesson-table row per lessons/NN_x.py"
    for stem in lessons:
        assert table[stem[:2]] and all(f"lessons/{stem}.py" in c for c in table[stem[:2]]), stem


def start_here_times() -> tuple[dict[str, int], dict[str, int], int, str]:
    """From README.md's Start here: ({lesson: exercise minutes}, {lesson: minutes on the whole path}, the path's
    hours, the section's text)."""
    text = section(read("README.md"), "## Start here")
    exercises = dict(
        re.findall(r"(\d\d): (\d+)", re.search(r"minutes by lesson: ([^)]*)\)", text).group(1))
    )
    path = re.search(r"take about (\d+) hours:\s*(.*?)\.\n", text, re.S)
    per_lesson = dict(re.findall(r"(\d\d) \((\d+)(?: min)?\)", path.group(2)))
    return (
        {k: int(v) for k, v in exercises.items()},
        {k: int(v) for k, v in per_lesson.items()},
        int(path.group(1)),
        text,
    )


def minutes(span: str) -> int:
    """ "5 h 35 min" -> 335, "1 h" -> 60, "35 min" -> 35."""
    hours, mins = re.search(r"(?:(\d+) h)?\s*(?:(\d+) min)?", span.strip()).groups()
    return 60 * int(hours or 0) + int(mins or 0)


def test_each_exercise_takes_about_a_minute_per_line_of_its_stub():
    exercises = importlib.import_module("exercises").EXERCISES
    stated, _, _, _ = start_here_times()
    stubs = {
        lesson: len(read(f"exercises/{name}.py").splitlines())
        for name, (lesson, _) in exercises.items()
    }
    assert sorted(stated) == sorted(stubs), (
        "README's exercise minutes name each lesson that has an exercise"
    )
    for lesson, lines in stubs.items():
        assert abs(stated[lesson] - lines) <= 5, (
            f"exercise of lesson {lesson}: {lines} stub lines, "
            f"README says {stated[lesson]} min: update both READMEs"
        )


def test_start_here_times_add_up_from_the_lesson_table_and_the_exercises():
    """Each lesson on the path is read + run + study + exercise, to the nearest 5 minutes; the path and the
    routes are the sums of those."""
    exercises, per_lesson, hours, text = start_here_times()
    table = {
        c[0]: c
        for c in table_rows(read("README.md"))
        if re.fullmatch(r"\d\d", c[0]) and len(c) == 5
    }
    assert sorted(per_lesson) == sorted(table), "the path names every lesson of the table"
    for lesson, cells in table.items():
        read_min = int(re.search(r"(\d+) min", cells[2]).group(1))
        run_s = int(re.search(r", (\d+) s", cells[3]).group(1))
        study = int(re.search(r"(\d+) min", cells[4]).group(1))
        exact = read_min + run_s / 60 + study + exercises.get(lesson, 0)
        assert per_lesson[lesson] % 5 == 0 and abs(per_lesson[lesson] - exact) <= 2.5, (
            f"lesson {lesson}: read {read_min} + run {run_s} s + study {study} + exercise "
            f"{exercises.get(lesson, 0)} = {exact:.1f} min, the path says {per_lesson[lesson]}"
        )
    assert abs(sum(per_lesson.values()) / 60 - hours) <= 0.5, (
        f"the path sums to {sum(per_lesson.values())} min"
    )
    for cells in table_rows(text)[1:]:
        lessons, time = re.sub(r"\]\([^)]*\)", "]", cells[1]), cells[2]
        main, _, extra = lessons.partition("(")
        assert minutes(time.split("(")[0]) == sum(
            per_lesson[n] for n in re.findall(r"\d\d", main)
        ), cells
        if extra:
            assert minutes(time.split("(+")[1]) == sum(
                per_lesson[n] for n in re.findall(r"\d\d", extra)
            ), cells


def row_links(text: str) -> dict[str, list[str]]:
    """{"03": ["minimal/03_ddp.py", "notebooks/03_ddp.ipynb"], ...}: each lesson-table row's link targets."""
    return {
        c[0]: LINK.findall(" | ".join(c))
        for c in table_rows(text)
        if re.fullmatch(r"\d\d", c[0]) and LESSON_FILE.search(" ".join(c))
    }


def test_lesson_table_reads_the_minimal_script_and_studies_the_notebook():
    for number, links in row_links(read("README.md")).items():
        assert any(re.fullmatch(rf"notebooks/{number}_\w+\.ipynb", t) for t in links), (
            f"{number}: study"
        )
        assert any(re.fullmatch(rf"(minimal|lessons)/{number}_\w+\.py", t) for t in links), (
            f"{number}: read"
        )


def test_chinese_lesson_table_links_the_chinese_guides_and_the_same_files():
    """Each row of README.zh-CN's table links this lesson's Chinese guide, beside the English row's links."""
    en, zh = row_links(read("README.md")), row_links(read("README.zh-CN.md"))
    assert sorted(zh) == sorted(en), "one row per lesson in both tables"
    for number, links in zh.items():
        guides = [t for t in links if re.fullmatch(rf"docs/zh/lessons/{number}_\w+\.md", t)]
        assert len(guides) == 1, f"README.zh-CN.md, row {number}: link its guide docs/zh/lessons/"
        assert (ROOT / guides[0]).is_file(), (
            f"README.zh-CN.md, row {number}: {guides[0]} is missing"
        )
        assert [t for t in links if t not in guides] == en[number], (
            f"README.zh-CN.md, row {number}: the English row's links, in order"
        )


def test_stated_minimal_script_lengths_match_the_files():
    """The read column says each minimal script's length ("87 lines"); checked once the script exists."""
    for cells in table_rows(read("README.md")):
        m = re.search(r"\]\((minimal/\d\d_\w+\.py)\), (\d+) lines", " | ".join(cells))
        if m and (ROOT / m.group(1)).is_file():
            lines = len(read(m.group(1)).splitlines())
            said = f"README.md says {m.group(1)} has {m.group(2)} lines, it has {lines}"
            assert lines == int(m.group(2)), (
                f"{said}: update both READMEs (read time: 12 lines a minute)"
            )


def test_every_docs_page_linked_from_the_readme_exists():
    linked = {t for t, _ in local_links(ROOT / "README.md") if t.startswith("docs/")}
    assert {
        "docs/README.md",
        "docs/glossary.md",
        "docs/myths.md",
        "docs/symptoms.md",
        "docs/launchers.md",
        "docs/gpus-and-nodes.md",
        "docs/speed.md",
    } <= linked
    missing = sorted(t for t in linked if not (ROOT / t).is_file() and not pending(t))
    assert missing == [], f"README.md links docs pages that do not exist: {missing}"


def test_every_page_under_docs_is_linked_from_the_readme_or_the_docs_index():
    """docs/zh/README.md indexes the Chinese pages (the lesson guides under docs/zh/lessons/ included)."""
    indexes = ("README.md", "docs/README.md", "README.zh-CN.md", "docs/zh/README.md")
    linked = {t for page in indexes if (ROOT / page).is_file() for t, _ in local_links(ROOT / page)}
    pages = {rel(p) for p in (ROOT / "docs").rglob("*.md")} - {"docs/README.md"}
    unlinked = sorted(pages - linked)
    assert unlinked == [], f"pages under docs/ that no README or docs index links: {unlinked}"


def test_every_relative_link_resolves():
    broken = []
    for page in markdown_pages():
        for target, anchor in local_links(page):
            if pending(target):
                continue
            if not (ROOT / target).exists():
                broken.append(f"{rel(page)} -> {target}")
            elif anchor and target.endswith(".md") and anchor not in anchors(read(target)):
                broken.append(f"{rel(page)} -> {target}#{anchor}")
    assert broken == [], f"links to nothing: {broken}"


def test_docs_and_docs_zh_mirror_each_other():
    en = {p.name for p in (ROOT / "docs").glob("*.md")}
    zh = {p.name for p in (ROOT / "docs" / "zh").glob("*.md")}
    assert sorted(en ^ zh) == [], (
        "each page under docs/ has its Chinese counterpart under docs/zh/ and back"
    )


def code_lines(text: str) -> set[str]:
    """The commands in fenced code blocks, trailing comments (which a translation may translate) dropped."""
    lines = set()
    for block in re.findall(r"```\w*\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+# .*$", "", line).strip()
            if line and not line.startswith("# "):
                lines.add(line)
    return lines


def commands(text: str) -> set[str]:
    """Backticked commands and paths: what a reader copies, kept verbatim in every language."""
    spans = set(re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)))
    return {
        s for s in spans if re.search(r"^(python|torchrun|bash|pip)\b|\w/\w|^--", s)
    } | code_lines(text)


def numbers(text: str) -> Counter:
    """Each number with how often it occurs (so that changing one "30 minutes" of two is caught); link targets
    left out."""
    return Counter(
        re.findall(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?", re.sub(r"\]\([^)]*\)", "]", text))
    )


def sections(text: str) -> list[str]:
    """The page cut at its `##`/`###` headings (a `# comment` inside a code block is no heading)."""
    fenced = re.sub(r"```.*?```", lambda m: m.group(0).replace("#", "\0"), text, flags=re.S)
    return re.split(r"^##+ .*$", fenced, flags=re.M)


def english_and_chinese_pages() -> list[tuple[Path, Path]]:
    pairs = [(ROOT / "README.md", ROOT / "README.zh-CN.md")]
    return pairs + [
        (p, ROOT / "docs" / "zh" / p.name)
        for p in sorted((ROOT / "docs").glob("*.md"))
        if (ROOT / "docs" / "zh" / p.name).is_file() and p.name != "symptoms.md"
    ]  # its own tests


def test_chinese_pages_keep_every_section_command_and_number_of_the_english_ones():
    for en, zh in english_and_chinese_pages():
        en_text, zh_text = en.read_text("utf-8"), zh.read_text("utf-8")
        assert sorted(commands(en_text) - commands(zh_text)) == [], (
            f"{rel(zh)} lacks commands of {rel(en)}"
        )
        en_sections, zh_sections = sections(en_text), sections(zh_text)
        assert len(zh_sections) == len(en_sections), (
            f"{rel(zh)}: one section per section of {rel(en)}"
        )
        for i, (en_part, zh_part) in enumerate(zip(en_sections, zh_sections)):
            lacking = numbers(en_part) - numbers(zh_part)
            assert not lacking, (
                f"{rel(zh)}, section {i}: lacks numbers of {rel(en)}: {dict(lacking)}"
            )


def glossary_terms(text: str) -> set[str]:
    """The terms the English glossary defines (its bold spans), each alias on its own: "rank / world_size"."""
    return {
        part.strip("` ").lower()
        for term in re.findall(r"\*\*([^*]+)\*\*", text)
        for part in re.split(r",\s*|\s+/\s+", term)
        if len(part.strip("` ")) > 1
    }


def test_chinese_glossary_has_a_row_for_every_english_term():
    zh = read("docs/zh/glossary.md").replace("`", "").lower()
    missing = sorted(term for term in glossary_terms(read("docs/glossary.md")) if term not in zh)
    assert missing == [], f"docs/zh/glossary.md has no row for: {missing}"


def symptom_rows(text: str) -> list[tuple[list[str], list[str]]]:
    """Each symptom-table row (both tables) as (its backticked texts in the first column, the lesson numbers
    it names: "lesson 05" in English, "第 05 课" in Chinese)."""
    rows = [c for c in table_rows(text) if len(c) >= 4 and "`" in c[0]]
    lesson = re.compile(r"(?:lesson |第 )(\d\d)")
    return [(re.findall(r"`([^`]+)`", c[0]), lesson.findall(" ".join(c[1:]))) for c in rows]


def test_chinese_symptom_rows_quote_the_same_error_texts_and_point_at_the_same_lessons():
    en, zh = symptom_rows(read("docs/symptoms.md")), symptom_rows(read("docs/zh/symptoms.md"))
    assert len(zh) == len(en), "docs/zh/symptoms.md: one row per row of docs/symptoms.md"
    for (en_texts, en_lessons), (zh_texts, zh_lessons) in zip(en, zh):
        lacking = sorted(set(en_texts) - set(zh_texts))
        assert lacking == [], f"docs/zh/symptoms.md lacks the English text {lacking}"
        assert zh_lessons == en_lessons, (
            f"docs/zh/symptoms.md: row of {en_texts[0][:50]!r} names lessons "
            f"{zh_lessons}, the English {en_lessons}"
        )


# --- The Chinese reading guide of each lesson: docs/zh/lessons/NN_x.md ---

NOTEBOOKS = (
    ROOT / "notebooks"
)  # the checkout's, also when a drift test points ROOT at a copy of the pages
GUIDE_SECTIONS = (
    "## 这一课讲什么",
    "## 术语",
    "## 命令",
    "## 输出里看什么",
    "## 纠正的误区",
    "## 练习与最小脚本",
)


def flat(text: str) -> str:
    """One line, single spaces: a docstring's command continued with a backslash reads as the guide's."""
    return re.sub(r"\s+", " ", text.replace("\\\n", " "))


def cell_text(cell: dict) -> str:
    """A code cell's printed output, flattened."""
    return flat(
        "\n".join(
            "".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
            for o in cell.get("outputs", [])
        )
    )


def notebook_runs(stem: str) -> list[tuple[list[tuple[str | None, list[str]]], str]]:
    """Each code cell of notebooks/<stem>.ipynb as (the launches of the lesson it makes, each as (nproc,
    args) with `--device cpu` left out; its output). nproc is None for one process (`python lessons/...`)."""
    path = NOTEBOOKS / f"{stem}.ipynb"
    if not path.is_file():
        return []
    out = []
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        launches = []
        for call in re.findall(rf'run_lesson\(\s*"{stem}"(.*?)\)\s*\.', source, re.S):
            nproc = re.search(r"nproc=(\w+)", call)
            listed = re.search(r"args=(\[[^\]]*\])", call, re.S)
            elements = ast.parse(listed.group(1), mode="eval").body.elts if listed else []
            # an argument computed in the cell (a temporary folder) matches any word of the command
            args = [e.value if isinstance(e, ast.Constant) else "*" for e in elements]
            for i in range(len(args) - 1):
                if args[i : i + 2] == ["--device", "cpu"]:
                    args = args[:i] + args[i + 2 :]
                    break
            launches.append(
                (None if not nproc or nproc.group(1) == "None" else nproc.group(1), args)
            )
        out.append((launches, cell_text(cell)))
    return out


def named_runs(guide: str, stem: str) -> list[tuple[str | None, list[str]]]:
    """The runs the output section names before its table: each backticked command of lessons/<stem>.py,
    as (nproc, args): `torchrun ... --nproc_per_node=2 lessons/03_ddp.py --check-equivalence`."""
    intro = section(guide, "## 输出里看什么").split("\n|", 1)[0]
    runs = []
    for command in re.findall(r"`([^`]*lessons/\d\d_\w+\.py[^`]*)`", intro):
        words = shlex.split(command)
        script = next(i for i, w in enumerate(words) if w.endswith(".py"))
        if words[script] != f"lessons/{stem}.py":
            continue
        nproc = next((w.split("=")[1] for w in words if w.startswith("--nproc_per_node=")), None)
        runs.append((nproc, words[script + 1 :]))
    return runs


def same_run(launch: tuple[str | None, list[str]], named: tuple[str | None, list[str]]) -> bool:
    (nproc, args), (named_nproc, named_args) = launch, named
    return (
        nproc == named_nproc
        and len(args) == len(named_args)
        and all(a in ("*", b) for a, b in zip(args, named_args))
    )


DEMO = "（notebook 内演示）"  # a row quoting a cell that runs in the notebook's kernel, launching nothing


def test_every_lesson_has_a_chinese_guide_linked_from_the_chinese_index():
    lessons = sorted(p.stem for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py"))
    guides = sorted(p.stem for p in (ROOT / "docs" / "zh" / "lessons").glob("*.md"))
    assert guides == lessons, "one guide docs/zh/lessons/NN_x.md per lessons/NN_x.py, and no other"
    linked = {t for t, _ in local_links(ROOT / "docs" / "zh" / "README.md")}
    assert (
        sorted(
            f"docs/zh/lessons/{s}.md" for s in lessons if f"docs/zh/lessons/{s}.md" not in linked
        )
        == []
    )


def test_each_chinese_guide_has_its_sections_commands_exercise_and_minimal_script():
    exercises = importlib.import_module("exercises").EXERCISES
    readme = lesson_map(read("README.md"))
    for path in sorted((ROOT / "docs" / "zh" / "lessons").glob("*.md")):
        guide, stem, name = path.read_text("utf-8"), path.stem, rel(path)
        assert guide.startswith(f"# 第 {stem[:2]} 课导读："), (
            f"{name}: title '# 第 {stem[:2]} 课导读：...'"
        )
        for heading in GUIDE_SECTIONS:
            section(guide, heading)  # fails naming the heading
        docstring = flat(importlib.import_module(f"lessons.{stem}").__doc__ or "")
        block = section(guide, "## 命令")
        for command in sorted(code_lines(block)):
            assert flat(command) in docstring, (
                f"{name}: {command!r} is not a command of lessons/{stem}.py"
            )
        for command in readme.get(stem[:2], []):
            assert command in code_lines(block), f"{name}: lacks the README's command {command!r}"
        runs = [c for c in code_lines(block) if f"lessons/{stem}.py" in c]
        assert runs, f"{name}: no command runs the lesson"
        for exercise, (lesson, _) in exercises.items():
            if lesson == stem[:2]:
                assert f"python -m exercises {exercise}" in guide, (
                    f"{name}: lacks its exercise {exercise}"
                )
                part = section(guide, "## 练习与最小脚本")
                assert "  - 要求：" in part and "  - 提示：" in part, (
                    f"{name}: the exercise's contract (要求) and hint (提示) in Chinese"
                )
        if (ROOT / "minimal" / f"{stem}.py").is_file():
            assert f"minimal/{stem}.py" in guide, f"{name}: lacks its minimal script"


def test_each_chinese_guide_quotes_output_lines_the_lessons_notebook_printed():
    """A guide's output lines are the committed notebook's, numbers included, and come from the run the
    section names (its command's process count and arguments): a lesson whose output changes (its notebook
    re-executed) makes its guide fail until the lines are updated, and a line from a run with other
    arguments than the named one fails too. A row marked DEMO quotes a cell that launches nothing."""
    for path in sorted((ROOT / "docs" / "zh" / "lessons").glob("*.md")):
        guide, stem = path.read_text("utf-8"), path.stem
        rows = [
            (m.replace("\\|", "|"), c[1] if len(c) > 1 else "")
            for c in table_rows(section(guide, "## 输出里看什么"))[1:]
            for m in re.findall(r"^`(.+)`$", c[0])
        ]
        assert len(rows) >= 3, f"{rel(path)}: quote at least 3 lines of the lesson's output"
        runs, cells = named_runs(guide, stem), notebook_runs(stem)
        assert runs, f"{rel(path)}: name the run quoted, `torchrun ... lessons/{stem}.py ARGS`"
        for line, meaning in rows:
            if meaning.startswith(DEMO):
                printed = [text for launches, text in cells if not launches]
            else:
                printed = [
                    text
                    for launches, text in cells
                    if any(same_run(launch, run) for launch in launches for run in runs)
                ]
            assert any(flat(line) in text for text in printed), (
                f"{rel(path)}: notebooks/{stem}.ipynb's "
                f"{'cells without a launch' if meaning.startswith(DEMO) else f'runs {runs}'} "
                f"never printed {line!r}"
            )


PARITY = test_chinese_pages_keep_every_section_command_and_number_of_the_english_ones
MIRROR = test_docs_and_docs_zh_mirror_each_other
LINKED = test_every_page_under_docs_is_linked_from_the_readme_or_the_docs_index
SYMPTOM_ROWS = test_chinese_symptom_rows_quote_the_same_error_texts_and_point_at_the_same_lessons
GUIDES = test_every_lesson_has_a_chinese_guide_linked_from_the_chinese_index
GUIDE_CONTENT = test_each_chinese_guide_has_its_sections_commands_exercise_and_minimal_script
GUIDE_OUTPUT = test_each_chinese_guide_quotes_output_lines_the_lessons_notebook_printed
# name: (page of the copy, text or regex to replace (None: delete or create the page), by what, check)
DRIFTS = {
    "myths deleted from the Chinese": ("docs/zh/myths.md", r"(?s)\n1\. .*", "\n", PARITY),
    "30 minutes made 5 in the Chinese": ("docs/zh/myths.md", "默认 30 分钟", "默认 5 分钟", PARITY),
    "a section added to the English only": (
        "docs/launchers.md",
        r"\Z",
        "\n## New\n\nText.\n",
        PARITY,
    ),
    "a command changed in the Chinese": (
        "README.zh-CN.md",
        "--trace-dir traces",
        "--trace-dir out",
        test_chinese_lesson_map_matches_the_english_one,
    ),
    "the Chinese glossary deleted": ("docs/zh/glossary.md", None, None, MIRROR),
    "a glossary row deleted": (
        "docs/zh/glossary.md",
        "| resharding |",
        "| (gone) |",
        test_chinese_glossary_has_a_row_for_every_english_term,
    ),
    "a page no index links": ("docs/orphan.md", None, "# Orphan\n", LINKED),
    "a link to a moved page": (
        "README.md",
        "docs/myths.md",
        "docs/m.md",
        test_every_relative_link_resolves,
    ),
    "a symptom row pointing at the wrong lesson": (
        "docs/zh/symptoms.md",
        "| `rank_skips_step` | 第 05 课",
        "| `rank_skips_step` | 第 03 课",
        SYMPTOM_ROWS,
    ),
    "an error text lost from a Chinese symptom row": (
        "docs/zh/symptoms.md",
        "Received data size doesn't",
        "Received data size does not",
        SYMPTOM_ROWS,
    ),
    "a lesson guide deleted": ("docs/zh/lessons/07_gradient_accumulation.md", None, None, GUIDES),
    "a guide's command changed": (
        "docs/zh/lessons/03_ddp.md",
        "--spawn 2",
        "--spawn 3",
        GUIDE_CONTENT,
    ),
    "a guide's exercise hint dropped": (
        "docs/zh/lessons/04_custom_sampler.md",
        "  - 提示：",
        "  - ",
        GUIDE_CONTENT,
    ),
    "a guide's section deleted": (
        "docs/zh/lessons/09_model_parallel.md",
        "## 纠正的误区",
        "纠正的误区",
        GUIDE_CONTENT,
    ),
    "a guide's exercise dropped": (
        "docs/zh/lessons/02_collectives.md",
        "python -m exercises ring_allreduce",
        "python -m exercises",
        GUIDE_CONTENT,
    ),
    "a guide's output number changed": (
        "docs/zh/lessons/01_single_gpu.md",
        "final test accuracy 0.9916",
        "final test accuracy 0.9961",
        GUIDE_OUTPUT,
    ),
    "a zh table row linking the English page": (
        "README.zh-CN.md",
        "[单设备](docs/zh/lessons/01_single_gpu.md)",
        "[单设备](docs/lessons.md)",
        test_chinese_lesson_table_links_the_chinese_guides_and_the_same_files,
    ),
    "a guide quoting a run with other arguments": (
        "docs/zh/lessons/03_ddp.md",
        "lessons/03_ddp.py --check-equivalence`",
        "lessons/03_ddp.py`",
        GUIDE_OUTPUT,
    ),
    "a guide no index links": (
        "docs/zh/README.md",
        "(lessons/05_uneven_data.md)",
        "(lessons.md)",
        GUIDES,
    ),
    "a README too long": (
        "README.md",
        r"\Z",
        " word" * 200,
        test_readme_is_a_map_of_at_most_1500_words,
    ),
}


@pytest.mark.parametrize("drift", sorted(DRIFTS))
def test_the_checks_catch_each_drift(drift, tmp_path, monkeypatch):
    """Each check fails on an edit it exists to catch, applied to a copy of the pages."""
    for page in markdown_pages():
        (tmp_path / rel(page)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(page, tmp_path / rel(page))
    for page in ("CONTRIBUTING.md", "tests/README.md"):  # the layout section links them
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, tmp_path / page)
    for folder in ("lessons", "minimal", "exercises"):  # the guides link them
        shutil.copytree(
            ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    (tmp_path / "notebooks").mkdir()
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):  # links need the names only
        (tmp_path / "notebooks" / notebook.name).touch()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    path, pattern, replacement, check = DRIFTS[drift]
    check()  # the unedited copy passes
    target = tmp_path / path
    if pattern is None and replacement is None:
        target.unlink()
    elif pattern is None:
        target.write_text(replacement, encoding="utf-8")
    else:
        text = target.read_text(encoding="utf-8")
        if pattern.startswith(("(?s)", "\\Z")):
            edited = re.sub(pattern, lambda m: replacement, text, count=1)
        else:
            edited = text.replace(pattern, replacement, 1)
        assert edited != text, f"the drift {drift!r} changed nothing"
        target.write_text(edited, encoding="utf-8")
    with pytest.raises(AssertionError):
        check()
