"""The Chinese glossary as a table of terms: one row per English term, and the Chinese words readers search
for present as aliases in the row of the term they name; the Chinese pages use one word per concept."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GLOSSARY = ROOT / "docs" / "zh" / "glossary.md"

# alias readers search for -> an English term of the row it belongs to
ALIASES = {
    "分布式训练": "distributed training",
    "单机多卡": "single-node",
    "多机多卡": "multi-node",
    "梯度检查点": "activation checkpointing",
    "全归约": "all-reduce",
    "集体通信": "collective",
    "空泡": "bubble",
    "梯度累加": "gradient accumulation",
    "全交换": "all-to-all",
    "全对全": "all-to-all",
}
# words the Chinese pages do not use (outside backticked output and the glossary row that names the alias)
RETIRED = {
    "梯度累加": "梯度累积",
    "展品": "复现案例",
    "全互换": "全交换（all-to-all）",
    "一前一后": "一次前向一次反向交替",
    "预约": "",
    "排名": "rank（编号）",
}


def rows(text: str) -> list[tuple[list[str], str]]:
    """Each table row below the header as (its English terms, the rest of the row)."""
    out = []
    for line in text.splitlines():
        if (
            not line.startswith("| ")
            or re.fullmatch(r"\|[\s:|-]+\|", line)
            or line.startswith("| English |")
        ):
            continue
        first, rest = line[2:].split(" | ", 1)
        out.append((terms(first), rest))
    return out


def terms(cell: str) -> list[str]:
    """The terms of a first column: "context parallelism (cp)" and "Context parallel (CP)" are one term
    (case, parentheses and the endings -ism / -s dropped); a backticked name is its own term: `RANK`, rank."""
    cell = re.sub(r"\([^)]*\)", "", cell).lower()
    parts = [p.strip() for p in re.split(r",\s*|\s+/\s+", cell) if p.strip()]
    return [" ".join(w.removesuffix("ism").removesuffix("s") for w in p.split()) for p in parts]


def duplicate_terms(text: str) -> list[str]:
    seen, dup = set(), []
    for names, _ in rows(text):
        for name in set(names):
            if name in seen:
                dup.append(name)
            seen.add(name)
    return sorted(dup)


def missing_aliases(text: str) -> list[str]:
    table = rows(text)
    found = {
        alias
        for alias, term in ALIASES.items()
        for names, rest in table
        if alias in rest and terms(term)[0] in names
    }
    return sorted(set(ALIASES) - found)


def test_one_row_per_english_term():
    assert duplicate_terms(GLOSSARY.read_text("utf-8")) == []


def test_the_aliases_readers_search_for_are_in_their_terms_rows():
    assert missing_aliases(GLOSSARY.read_text("utf-8")) == []


def test_a_planted_duplicate_row_and_a_lost_alias_fail():
    text = GLOSSARY.read_text("utf-8")
    planted = text.replace("| Ulysses |", "| Ulysses | Ulysses | again |\n| Ulysses |", 1)
    assert duplicate_terms(planted) == ["ulysse"]
    again = "| context parallelism (cp) | 上下文并行 | again |\n| Context parallel (CP) |"
    renamed = text.replace("| context parallelism (cp) |", again, 1)
    assert duplicate_terms(renamed) == ["context parallel"]
    assert missing_aliases(text.replace("梯度检查点", "检查点")) == ["梯度检查点"]


def chinese_pages() -> list[Path]:
    return [ROOT / "README.zh-CN.md", *sorted((ROOT / "docs" / "zh").rglob("*.md"))]


@pytest.mark.parametrize("word", sorted(RETIRED))
def test_the_chinese_pages_use_one_word_per_concept(word):
    """梯度累加 stays as the glossary's alias only, 排名 only where a page says rank is not one; the other words are
    gone (backticked output excepted)."""
    hits = []
    for page in chinese_pages():
        for line in page.read_text("utf-8").splitlines():
            prose = re.sub(r"`[^`]*`", "", line)
            alias_row = page == GLOSSARY and word in ALIASES
            negated = word == "排名" and re.search(r"不是.{0,2}排名|不是名次", prose)
            if word in prose and not alias_row and not negated:
                hits.append(f"{page.relative_to(ROOT)}: {prose.strip()[:60]}")
    assert hits == [], f"{word!r} (write {RETIRED[word]!r}): {hits}"


SEARCH_WORDS = ("分布式训练", "单机多卡", "多机多卡")


@pytest.mark.parametrize("page", chinese_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_chinese_page_has_the_search_words_in_its_title_or_intro(page):
    """The words Chinese readers search for (distributed training, one node / several nodes with several
    GPUs) stand in the title or the intro, the text before the page's first section."""
    top = page.read_text(encoding="utf-8").split("\n## ", 1)[0]
    missing = [w for w in SEARCH_WORDS if w not in top]
    assert missing == [], f"{page.relative_to(ROOT)}: the title and intro lack {missing}"
