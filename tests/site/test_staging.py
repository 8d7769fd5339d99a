"""The website's staging, without Sphinx or a browser: it is laid afresh from the sources at each build (a
changed notebook shows at the next build), slugs come from the lesson names, and the language switch says so
where a page has no counterpart."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

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
    cell = next(c for c in nb["cells"] if any(o["output_type"] == "stream" for o in c.get("outputs", [])))
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
    missing = template.render(website_lang="zh", other_docnames={"index"}, pagename="lessons/ddp/index")
    assert "No English version of this page" in missing and 'href="../../../en/index.html"' in missing
    page = "lessons/ddp/index"
    found = template.render(website_lang="en", other_docnames={page}, pagename=page)
    assert 'href="../../../zh/lessons/ddp/index.html"' in found and "中文" in found
