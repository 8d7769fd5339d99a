"""What the website's pages hold, read from the built HTML and the staging tree: a lesson page shows exactly
the outputs its committed notebook holds (every stream text and every image, byte for byte, in order, and
nothing else), staging is laid afresh from the sources at each build, and the lesson pages carry their
minimal script, measured lesson, exercise and neighbours."""
from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest

from website import build as site_build

ROOT = Path(__file__).resolve().parents[2]


def notebook_outputs(path: Path) -> list[tuple[str, object]]:
    """("stream", text) and ("image", png bytes) of a notebook's outputs, in order."""
    found = []
    for cell in json.loads(path.read_text())["cells"]:
        for output in cell.get("outputs", []):
            if output["output_type"] == "stream":
                found.append(("stream", "".join(output["text"]).rstrip("\n")))
            elif "image/png" in output.get("data", {}):
                found.append(("image", base64.b64decode("".join(output["data"]["image/png"]))))
            else:
                found.append(("text", "".join(output.get("data", {}).get("text/plain", ""))))
    return found


def page_outputs(page: Path) -> list[tuple[str, object]]:
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(page.read_text(), "html.parser")
    found = []
    for box in soup.select("div.cell_output"):
        for output in box.find_all(recursive=False):
            img = output.find("img")
            if img is not None:
                found.append(("image", (page.parent / img["src"]).read_bytes()))
            elif "stream" in output.get("class", []) or "stderr" in output.get("class", []):
                found.append(("stream", output.find("pre").get_text().rstrip("\n")))
            else:
                found.append(("text", output.get_text()))
    return found


@pytest.mark.slow
def test_each_lesson_page_shows_exactly_its_notebooks_outputs(site):
    lessons = site_build.curriculum()
    assert len(lessons) == len(list((ROOT / "notebooks").glob("*.ipynb")))
    for lesson in lessons:
        expected = notebook_outputs(ROOT / "notebooks" / f"{lesson.stem}.ipynb")
        shown = page_outputs(site / "en" / f"{lesson.page}.html")
        assert [k for k, _ in shown] == [k for k, _ in expected], lesson.stem
        for i, (a, b) in enumerate(zip(shown, expected)):
            assert a == b, f"{lesson.stem}: output {i} on the page differs from the notebook's"


@pytest.mark.slow
def test_lesson_pages_hold_script_lesson_exercise_and_neighbours(site):
    from bs4 import BeautifulSoup

    for lang in ("en", "zh"):
        soup = BeautifulSoup((site / lang / "lessons/ddp/index.html").read_text(), "html.parser")
        text = soup.get_text()
        assert soup.find(id=f"{lang}-ddp-minimal") and soup.find(id=f"{lang}-ddp-lesson")
        assert soup.find(id=f"{lang}-ddp-exercise")
        assert "+++ minimal/03_ddp.py" in text and "init_process_group" in text  # the diff from 01
        assert "torchrun --standalone --nproc_per_node=2 lessons/03_ddp.py --check-equivalence" in text
        assert "replicas_identical" in text  # a claim's name, parsed from the lesson's source
        assert "python -m exercises ddp_by_hand" in text
        solution = soup.find("details", class_="sd-dropdown", string=None)
        assert solution is not None and "open" not in solution.attrs  # answers stay collapsed
        hrefs = [a.get("href", "") for a in soup.find_all("a")]
        assert any(h.endswith("collectives/index.html") for h in hrefs)  # previous: 02
        assert any(h.endswith("custom-sampler/index.html") for h in hrefs)  # next: 04


@pytest.mark.slow
def test_redirects_cover_every_numbered_name(site):
    for lang in ("en", "zh"):
        for lesson in site_build.curriculum():
            for folder in ("lessons", "notebooks"):
                page = (site / lang / folder / f"{lesson.stem}.html").read_text()
                target = f"../lessons/{lesson.slug}/index.html"
                assert f'url={target}"' in page and (site / lang / folder / target).resolve().exists()


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
    found = template.render(website_lang="en", other_docnames={"lessons/ddp/index"}, pagename="lessons/ddp/index")
    assert 'href="../../../zh/lessons/ddp/index.html"' in found and "中文" in found
