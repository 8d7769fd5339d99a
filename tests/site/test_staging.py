"""The website's staging, without Sphinx or a browser: it is laid afresh from the sources at each build (a
changed notebook shows at the next build), slugs come from the lesson names, and the language switch says so
where a page has no counterpart. The generated text of the staged pages: route goals linked, lesson lists that
say what each lesson covers, the home page without the README's line about the READMEs, the Chinese pages'
own words in Chinese, one row of links under a lesson's title, no nbval markers in the code shown."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from website import build as site_build

ROOT = Path(__file__).resolve().parents[2]


def copy_sources(dest: Path):
    for name in ("README.md", "README.zh-CN.md"):
        shutil.copy(ROOT / name, dest / name)
    for name in ("lessons", "minimal", "notebooks", "docs", "exercises"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))


def test_a_changed_notebook_changes_its_staged_page(tmp_path, monkeypatch):
    """Staging is laid afresh from the sources: change a committed output, and the next staging shows it."""
    sources = tmp_path / "repo"
    sources.mkdir()
    copy_sources(sources)
    monkeypatch.setattr(site_build, "ROOT", sources)
    lessons = site_build.curriculum()
    staged = site_build.stage("en", lessons, tmp_path / "stage")
    page = staged / "lessons" / "ddp" / "index.ipynb"
    before = page.read_text()
    path = sources / "notebooks" / "03_ddp.ipynb"
    nb = json.loads(path.read_text())
    cell = next(
        c for c in nb["cells"] if any(o["output_type"] == "stream" for o in c.get("outputs", []))
    )
    stream = next(o for o in cell["outputs"] if o["output_type"] == "stream")
    stream["text"] = ["a line the committed notebook never printed\n"]
    path.write_text(json.dumps(nb))
    (staged / "lessons" / "leftover.md").write_text("# stale\n")
    staged = site_build.stage("en", site_build.curriculum(), tmp_path / "stage")
    after = (staged / "lessons" / "ddp" / "index.ipynb").read_text()
    assert "a line the committed notebook never printed" in after and after != before
    assert not (staged / "lessons" / "leftover.md").exists()


def test_slugs_come_from_the_lesson_names():
    lessons = site_build.curriculum()
    assert [lesson.slug for lesson in lessons][:3] == ["single-gpu", "collectives", "ddp"]
    assert site_build.slug_of("21_ddp") == "ddp"  # a renumbered lesson keeps its address
    assert len({lesson.slug for lesson in lessons}) == len(lessons)


def test_language_switch_says_so_where_a_page_has_no_counterpart():
    import jinja2

    template = jinja2.Template((ROOT / "website/templates/lang-switch.html").read_text())
    missing = template.render(
        website_lang="zh", other_docnames={"index"}, pagename="lessons/ddp/index"
    )
    assert (
        "No English version of this page" in missing and 'href="../../../en/index.html"' in missing
    )
    page = "lessons/ddp/index"
    found = template.render(website_lang="en", other_docnames={page}, pagename=page)
    assert 'href="../../../zh/lessons/ddp/index.html"' in found and "中文" in found


# ---- the staged pages' text, both languages ----------------------------------------------------------------
@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> dict[str, Path]:
    lessons = site_build.curriculum()
    root = tmp_path_factory.mktemp("stage")
    return {lang: site_build.stage(lang, lessons, root) for lang in site_build.LANGS}


def test_first_sentence_of_a_docstring():
    doc = "Lesson 02: collectives -- a group, a ring from send/recv,\nno server. Then more.\n\nNext one."
    assert (
        site_build.first_sentence(doc) == "Collectives — a group, a ring from send/recv, no server."
    )
    assert (
        site_build.first_sentence("Lesson 21: plans -- will it fit? A model.")
        == "Plans — will it fit?"
    )
    assert site_build.plain("__len__, [x](y) | z") == r"\_\_len\_\_, \[x\]\(y\) \| z"


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_route_goals_link_to_their_route_pages(staged, lang):
    """The routes index and the home page's routes table link each goal to its page; a route's lessons and
    links are rewritten as on the home page, the route's own link is left as it is."""
    index, home = (
        (staged[lang] / "routes/index.md").read_text(),
        (staged[lang] / "index.md").read_text(),
    )
    routes = site_build.routes(lang)
    assert len(routes) == 4
    for route in routes:
        assert f"- [{route['goal']}]({route['slug']}/index.md)" in index
        assert f"| [{route['goal']}](routes/{route['slug']}/index.md) |" in home
        assert (staged[lang] / f"routes/{route['slug']}/index.md").exists()
    assert (
        "/index.md`)" not in index and "(`" not in index
    )  # no target left unresolved as "label (`path`)"


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_lesson_lists_say_what_each_lesson_covers(staged, lang):
    """The lesson index's third column has a header and, per lesson, a whole sentence shown as written
    (English: the docstring's first sentence, Markdown escaped) or the Chinese guide's title."""
    lessons = site_build.curriculum()
    text = (staged[lang] / "lessons/index.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| # |"))
    assert all(cell.strip() for cell in header.strip("|").split("|")), header
    rows = [row for row in site_build.table_rows(text) if row[0].isdigit()]
    assert len(rows) == len(lessons)
    for row, lesson in zip(rows, lessons):
        said = row[2]
        assert "--" not in said and not said.startswith("Lesson "), said
        if lang == "en":
            assert said.endswith((".", "?", "!")), said  # not cut mid-sentence
        else:
            guide = (ROOT / f"docs/zh/lessons/{lesson.stem}.md").read_text().partition("\n")[0]
            shown = re.sub(
                r"\\(.)", r"\1", said
            )  # Markdown escapes undone: reshard\_after -> reshard_after
            assert said and guide.endswith(shown) and "导读" not in said, (said, guide)
    if lang == "en":
        assert r"\_\_len\_\_" in text  # lesson 04's __len__: shown as written, not as a bold "len"
        assert "send/recv, no server." in text
    route = (staged[lang] / "routes/train-on-2-8-gpus/index.md").read_text()
    said = site_build.plain(site_build.summary(lessons[4], lang))
    assert route.count(said) == 1, said  # lesson 05's, once (not twice where the topic says it)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_home_page_has_no_line_about_the_readmes_and_the_site(staged, lang):
    home = (staged[lang] / "index.md").read_text()
    assert "build/site/index.html" not in home and "README.zh-CN.md" not in home
    title, _, rest = home.partition("\n\n")
    assert title.startswith("# ") and rest.strip()


def test_chinese_home_page_says_its_notebooks_are_english(staged):
    home = (staged["zh"] / "index.md").read_text()
    rows = [row for row in site_build.table_rows(home) if len(row) == 5 and row[0].isdigit()]
    lessons = site_build.curriculum()
    assert len(rows) == len(lessons)
    for row, lesson in zip(rows, lessons):
        assert ">notebook（英文）</a>" in row[4] and '<a href="../en/lessons/' in row[4], row[4]
        assert re.search(r"\[导读\]\(lessons/[a-z0-9-]+/index\.md\)", row[4]), row[4]
        chinese = f"[notebook（中文）](lessons/{lesson.slug}/notebook.ipynb)"
        assert (chinese in row[4]) == lesson.translated, row[4]


def test_chinese_lesson_pages_have_one_row_of_links(staged):
    """The guide's own paragraph of links is replaced by the generated row; the links it alone has (the
    glossary, the launchers, the symptom index) are kept in that row."""
    for lesson in site_build.curriculum():
        text = (staged["zh"] / f"{lesson.page}.md").read_text()
        title, nav, rest = text.split("\n\n", 2)
        assert title.startswith("# 第") and nav.startswith(("[←", "[02 →")), nav
        assert "全部导读" not in text and "课程文件 lessons/" not in rest.split("\n\n")[0]
        assert not rest.startswith("["), rest[:80]
        guide = (ROOT / f"docs/zh/lessons/{lesson.stem}.md").read_text()
        if "[术语对照]" in guide:
            assert "[术语对照](../../docs/glossary/index.md)" in nav
        if "[症状索引]" in guide.split("\n\n")[1]:
            assert "[症状索引](../../docs/symptoms/index.md)" in nav


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_exercise_link_only_where_a_lesson_has_one(lang):
    lessons = site_build.curriculum()
    without = [lesson.number for lesson in lessons if not lesson.exercises]
    assert without == ["01", "08", "11", "12", "17"]
    for lesson in lessons:
        line = site_build.nav_line(lesson, lessons, lang, lesson.page)
        assert (f"(#{lang}-{lesson.slug}-exercise)" in line) == bool(lesson.exercises), line
        assert f"(#{lang}-{lesson.slug}-minimal)" in line


def test_staged_notebooks_have_no_nbval_markers(staged):
    """The markers are for the tests, not the reader; the outputs stay as committed."""
    marked = 0
    for lesson in site_build.curriculum():
        source = json.loads((ROOT / f"notebooks/{lesson.stem}.ipynb").read_text())
        pages = [staged["en"] / f"{lesson.page}.ipynb"]
        if lesson.translated:  # the Chinese notebook page: the same code and outputs
            pages.append(staged["zh"] / f"{lesson.notebook_page}.ipynb")
        code = [c for c in source["cells"] if c["cell_type"] == "code"]
        marked += sum("NBVAL_" in "".join(c["source"]) for c in code)
        for path in pages:
            shown = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
            assert [c["outputs"] for c in shown] == [c["outputs"] for c in code], path
            for before, after in zip(code, shown):
                before = "".join(before["source"])
                assert "NBVAL_" not in after["source"]
                assert after["source"] == "\n".join(
                    line for line in before.split("\n") if line.strip() != "# NBVAL_IGNORE_OUTPUT"
                )
    assert marked >= 30


def test_chinese_generated_text_uses_chinese_colons(staged):
    for lesson in site_build.curriculum():
        text = (staged["zh"] / f"{lesson.page}.md").read_text()
        assert "- 上一课：" in text and "- 下一课：" in text
        assert "上一课:" not in text and "下一课:" not in text
    for route in site_build.routes("zh"):
        text = (staged["zh"] / f"routes/{route['slug']}/index.md").read_text()
        assert "时间：" in text and "时间:" not in text and "): " not in text
