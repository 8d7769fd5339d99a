"""The built website, English and Chinese, built once for the session from the sources as they are now.

In a real headless Chromium: every page loads whole from the site alone (no console error, no failed request,
nothing fetched from outside), every notebook image renders, search finds the right page first in both
languages, the language switch lands on the counterpart and back, every page fits a 375-pixel phone, and
screenshots of three pages are written for a person to look at. From the built HTML: a lesson page shows
exactly the outputs its committed notebook holds (every stream text and every image, byte for byte, in order,
and nothing else), and carries its minimal script, measured lesson, exercise and neighbours.

One file, so that pytest-xdist's --dist loadfile builds the site once, on one worker.
"""

from __future__ import annotations

import base64
import json
import re
import time
from pathlib import Path

import pytest

from tests.site.conftest import ARTIFACTS  # where the screenshots go
from website import build as site_build

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

REDIRECT_FOLDERS = (
    "lessons",
    "notebooks",
)  # numbered names, e.g. lessons/03_ddp.html: redirects only


def pages(site: Path) -> list[str]:
    """Every page of both languages, relative to the site's root, redirects left out."""
    found = []
    for path in sorted(site.rglob("*.html")):
        rel = path.relative_to(site).as_posix()
        parts = rel.split("/")
        if len(parts) == 3 and parts[1] in REDIRECT_FOLDERS and parts[2][:2].isdigit():
            continue
        if parts[0] in ("en", "zh") and not parts[1].startswith("_"):
            found.append(rel)
    return found


def settle(driver, timeout_s: float = 30.0):
    """Wait until the page, its images and its math (MathJax, where the page has it) are done."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = driver.execute_script(
            "return document.readyState === 'complete' && "
            "Array.from(document.images).every(i => i.complete) && "
            "(!document.querySelector('.math') || !!document.querySelector('mjx-container'));"
        )
        if done:
            break
        time.sleep(0.1)
    time.sleep(0.2)  # late requests (fonts) show up in the log


def drain(driver) -> tuple[list[dict], list[dict]]:
    """(console entries, network events) logged since the last call."""
    console = driver.get_log("browser")
    events = [json.loads(e["message"])["message"] for e in driver.get_log("performance")]
    return console, events


def visit(driver, url: str) -> dict:
    drain(driver)
    driver.get(url)
    settle(driver)
    console, events = drain(driver)
    requests, failed, bad_status = [], [], []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Network.requestWillBeSent":
            requests.append(params["request"]["url"])
        elif method == "Network.loadingFailed":
            failed.append(f"{params.get('errorText')} ({params.get('type')})")
        elif method == "Network.responseReceived" and params["response"]["status"] >= 400:
            bad_status.append(f"{params['response']['status']} {params['response']['url']}")
    width = driver.execute_script(
        "return [document.documentElement.scrollWidth, document.documentElement.clientWidth];"
    )
    clipped = driver.execute_script(  # text cut off at the edge, not only scrolled
        "return Array.from(document.querySelectorAll('.bd-article :is(h1, h2, h3, p, li)'))"
        ".filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.textContent.slice(0, 40));"
    )
    images = driver.execute_script(
        "return Array.from(document.querySelectorAll('img')).map("
        "i => [i.getAttribute('src'), i.naturalWidth, !!i.closest('.cell_output')]);"
    )
    return {
        "console": [e["message"] for e in console if e["level"] == "SEVERE"],
        "requests": requests,
        "failed": failed,
        "bad_status": bad_status,
        "images": images,
        "width": width,
        "clipped": clipped,
    }


@pytest.fixture(scope="session")
def visits(browser, site, server) -> dict[str, dict]:
    """Every page, loaded once on a 375-pixel-wide phone screen: what the browser logged and requested while
    loading it, its images, and how wide its content is."""
    browser.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": 375, "height": 812, "deviceScaleFactor": 2, "mobile": True},
    )
    try:
        return {rel: visit(browser, f"{server}/{rel}") for rel in pages(site)}
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_every_page_loads_with_no_error_and_nothing_from_outside(visits, server):
    assert len(visits) > 60, sorted(visits)
    problems = []
    for rel, seen in visits.items():
        outside = [
            u for u in seen["requests"] if not u.startswith((server + "/", "data:", "blob:"))
        ]
        for kind, items in (
            ("console error", seen["console"]),
            ("request to outside the site", outside),
            ("failed request", seen["failed"]),
            ("HTTP error", seen["bad_status"]),
        ):
            problems += [f"{rel}: {kind}: {item}" for item in items]
    assert not problems, "\n".join(problems[:40])


@pytest.mark.parametrize(
    "page", ["en/lessons/sync-batchnorm/index.html", "zh/lessons/sync-batchnorm/notebook.html"]
)
def test_math_is_typeset_from_the_site(visits, server, browser, page):
    if page not in visits:  # the Chinese notebook page exists once its catalog is translated
        pytest.skip(f"{page} not built")
    assert any("/_static/mathjax/" in u for u in visits[page]["requests"]), visits[page]["requests"]
    browser.get(f"{server}/{page}")
    settle(browser)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not browser.find_elements(
        "css selector", "mjx-container"
    ):
        time.sleep(0.2)
    assert browser.find_elements("css selector", "mjx-container"), (
        f"MathJax typeset nothing on notebook 06 ({page})"
    )


def test_every_notebook_image_renders(visits, site):
    lesson_pages = [
        rel for rel in visits if rel.startswith("en/lessons/") and rel != "en/lessons/index.html"
    ]
    assert len(lesson_pages) == len(
        list((site.parent / "site-src" / "en" / "lessons").glob("*/index.ipynb"))
    )
    shown = 0
    for rel in lesson_pages:
        for src, width, in_output in visits[rel]["images"]:
            assert width > 0, f"{rel}: image {src} did not render"
            shown += in_output
    assert shown >= 40, f"only {shown} notebook images on the lesson pages"


def results(driver, server: str, rel: str, query: str) -> list[str]:
    """The pages a search lists, in order (their addresses relative to the server)."""
    driver.get(f"{server}/{rel}?q={query}")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        links = driver.find_elements("css selector", "#search-results ul.search li > a")
        summary = driver.find_elements("css selector", "#search-results .search-summary")
        if links and summary and summary[0].text:
            return [a.get_attribute("href").removeprefix(server).split("#")[0] for a in links]
        time.sleep(0.2)
    raise AssertionError(f"search for {query!r} showed no result")


# set_epoch is in the body of several lessons' pages (no title holds it); Sphinx ranks equal matches by title,
# so the first is the lesson that introduces it (03, DDP's DistributedSampler), then 04, the sampler lesson.
# The Chinese terms are in their guide's title: jieba keeps them whole with the course's words (course_words).
@pytest.mark.parametrize(
    "lang,query,pages",
    [
        (
            "en",
            "set_epoch",
            ["/en/lessons/ddp/index.html", "/en/lessons/custom-sampler/index.html"],
        ),
        ("zh", "梯度累积", ["/zh/lessons/gradient-accumulation/index.html"]),
        ("zh", "同步批归一化", ["/zh/lessons/sync-batchnorm/index.html"]),
    ],
)
def test_search_finds_the_right_page_first(browser, server, visits, lang, query, pages):
    found = results(browser, server, f"{lang}/search.html", query)
    # reference pages that name the term in a table (docs/libraries: what fabric.setup_dataloaders calls) may
    # rank beside the lessons; among the lessons the one that teaches it comes first
    lessons = [page for page in found if "/lessons/" in page]
    assert lessons[: len(pages)] == pages, f"search for {query!r} listed {found[:5]}"
    assert set(found[: len(pages) + 1]) >= set(pages), f"search for {query!r} listed {found[:5]}"


@pytest.mark.parametrize(
    "start,counterpart",
    [
        ("en/lessons/ddp/index.html", "zh/lessons/ddp/index.html"),
        ("en/docs/glossary/index.html", "zh/docs/glossary/index.html"),
        ("en/index.html", "zh/index.html"),
    ],
)
def test_language_switch_round_trips(browser, server, visits, start, counterpart):
    browser.get(f"{server}/{start}")
    browser.find_element("id", "lang-switch").click()
    settle(browser)
    assert browser.current_url == f"{server}/{counterpart}"
    browser.find_element("id", "lang-switch").click()
    settle(browser)
    assert browser.current_url == f"{server}/{start}"


def test_numbered_names_redirect_to_the_slug(browser, server, visits):
    for old, new in (
        ("en/notebooks/03_ddp.html", "en/lessons/ddp/index.html"),
        ("zh/lessons/07_gradient_accumulation.html", "zh/lessons/gradient-accumulation/index.html"),
    ):
        browser.get(f"{server}/{old}")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not browser.current_url.endswith(new):
            time.sleep(0.1)
        assert browser.current_url == f"{server}/{new}"


def test_no_page_scrolls_sideways_on_a_phone(visits):
    """Every page was loaded at 375 px (see `visits`): nothing wider than the screen, no text cut at its edge
    (wide code and tables scroll inside their own box)."""
    problems = []
    for rel, seen in visits.items():
        width, view = seen["width"]
        if view != 375 or width > view:
            problems.append(f"{rel}: content {width} px wide in a {view} px viewport")
        problems += [f"{rel}: text wider than the screen: {text!r}" for text in seen["clipped"]]
    assert not problems, "\n".join(problems[:40])


def test_screenshots(browser, server, visits):
    """Written for a person to open: an English lesson, a Chinese guide and notebook, the home page."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for rel, name in (
        ("en/lessons/ddp/index.html", "en-lesson-ddp.png"),
        ("zh/lessons/gradient-accumulation/index.html", "zh-guide-gradient-accumulation.png"),
        ("zh/lessons/collectives/notebook.html", "zh-notebook-collectives.png"),
        ("en/index.html", "en-home.png"),
    ):
        browser.get(f"{server}/{rel}")
        settle(browser)
        assert browser.save_screenshot(str(ARTIFACTS / name))
        assert (ARTIFACTS / name).stat().st_size > 10_000
    print(f"screenshots: {ARTIFACTS}")


# ---- the built pages against their sources ----------------------------------------------------------------
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def notebook_outputs(path: Path) -> list[tuple[str, object]]:
    """("stream", text) and ("image", png bytes) of a notebook's outputs, in order."""
    found = []
    for cell in json.loads(path.read_text())["cells"]:
        for output in cell.get("outputs", []):
            if output["output_type"] == "stream":
                text = ANSI.sub("", "".join(output["text"]))  # colours: shown as colours, not codes
                # Pygments drops a stream's leading and trailing blank lines on the page
                found.append(("stream", text.strip("\n")))
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
            img = output if output.name == "img" else output.find("img")
            if img is not None:
                found.append(("image", (page.parent / img["src"]).read_bytes()))
            elif "stream" in output.get("class", []) or "stderr" in output.get("class", []):
                found.append(("stream", output.find("pre").get_text().strip("\n")))
            else:
                found.append(("text", output.get_text()))
    return found


def test_each_lesson_page_shows_exactly_its_notebooks_outputs(site):
    lessons = site_build.curriculum()
    assert len(lessons) == len(list((ROOT / "notebooks").glob("*.ipynb")))
    for lesson in lessons:
        expected = notebook_outputs(ROOT / "notebooks" / f"{lesson.stem}.ipynb")
        shown = page_outputs(site / "en" / f"{lesson.page}.html")
        assert [k for k, _ in shown] == [k for k, _ in expected], lesson.stem
        for i, (a, b) in enumerate(zip(shown, expected)):
            assert a == b, f"{lesson.stem}: output {i} on the page differs from the notebook's"


def test_each_chinese_notebook_page_shows_its_notebooks_outputs_and_chinese_prose(site):
    """A translated notebook's Chinese page (website/i18n.py): the committed outputs, exactly; its prose
    from the catalog; linked from its Chinese guide and its English page, and back."""
    from bs4 import BeautifulSoup

    translated = [lesson for lesson in site_build.curriculum() if lesson.translated]
    assert translated
    for lesson in translated:
        expected = notebook_outputs(ROOT / "notebooks" / f"{lesson.stem}.ipynb")
        page = site / "zh" / f"{lesson.notebook_page}.html"
        shown = page_outputs(page)
        assert [k for k, _ in shown] == [k for k, _ in expected], lesson.stem
        for i, (a, b) in enumerate(zip(shown, expected)):
            assert a == b, (
                f"{lesson.stem}: output {i} on the Chinese page differs from the notebook's"
            )
        soup = BeautifulSoup(page.read_text(), "html.parser")
        title = soup.select_one("article h1").get_text()
        assert re.search(r"[\u4e00-\u9fff]", title) and f"第 {lesson.number} 课" in title, title
        assert soup.find("a", href="index.html", string="导读")
        guide = (site / "zh" / f"{lesson.page}.html").read_text()
        assert 'href="notebook.html"' in guide, lesson.stem
        english = (site / "en" / f"{lesson.page}.html").read_text()
        assert f'href="../../../zh/{lesson.notebook_page}.html"' in english, lesson.stem
        switch = soup.select_one("#lang-switch")
        assert switch["href"] == f"../../../en/{lesson.page}.html", lesson.stem
    home = BeautifulSoup((site / "zh" / "index.html").read_text(), "html.parser")
    linked = {a["href"] for a in home.select("article a") if a.get_text() == "notebook（中文）"}
    assert linked == {f"{lesson.notebook_page}.html" for lesson in translated}


def test_lesson_pages_hold_script_lesson_exercise_and_neighbours(site):
    from bs4 import BeautifulSoup

    for lang in ("en", "zh"):
        soup = BeautifulSoup((site / lang / "lessons/ddp/index.html").read_text(), "html.parser")
        text = soup.get_text()
        assert soup.find(id=f"{lang}-ddp-minimal") and soup.find(id=f"{lang}-ddp-lesson")
        assert soup.find(id=f"{lang}-ddp-exercise")
        assert "+++ minimal/03_ddp.py" in text and "init_process_group" in text  # the diff from 01
        assert (
            "torchrun --standalone --nproc_per_node=2 lessons/03_ddp.py --check-equivalence" in text
        )
        assert "replicas_identical" in text  # a claim's name, parsed from the lesson's source
        assert "python -m exercises ddp_by_hand" in text
        solution = soup.find("details", class_="sd-dropdown", string=None)
        assert solution is not None and "open" not in solution.attrs  # answers stay collapsed
        hrefs = [a.get("href", "") for a in soup.find_all("a")]
        assert any(h.endswith("collectives/index.html") for h in hrefs)  # previous: 02
        assert any(h.endswith("custom-sampler/index.html") for h in hrefs)  # next: 04


def test_redirects_cover_every_numbered_name(site):
    for lang in ("en", "zh"):
        for lesson in site_build.curriculum():
            for folder in ("lessons", "notebooks"):
                page = (site / lang / folder / f"{lesson.stem}.html").read_text()
                target = f"../lessons/{lesson.slug}/index.html"
                assert (
                    f'url={target}"' in page and (site / lang / folder / target).resolve().exists()
                )


def test_generated_text_reads_right_in_both_languages(site):
    """Route goals link to their pages, lesson lists say what each lesson covers under a header, the Chinese
    home page says its notebooks are English, a lesson's link row is one row and names an exercise only
    where there is one, nbval's markers stay out of the code, and the Chinese pages' own words are Chinese
    down to the colons and the footer."""
    from bs4 import BeautifulSoup

    def soup(rel: str):
        return BeautifulSoup((site / rel).read_text(), "html.parser")

    lessons = site_build.curriculum()
    for lang in ("en", "zh"):
        for rel, prefix in (("routes/index.html", ""), ("index.html", "routes/")):
            hrefs = {a.get("href") for a in soup(f"{lang}/{rel}").select("article a")}
            for route in site_build.routes(lang):
                assert f"{prefix}{route['slug']}/index.html" in hrefs, (lang, rel, route["slug"])
        index = soup(f"{lang}/lessons/index.html")
        heads = [th.get_text(strip=True) for th in index.select("article table th")]
        assert len(heads) == 3 and all(heads), heads
        cells = [tr.select("td")[2].get_text() for tr in index.select("article table tbody tr")]
        assert len(cells) == len(lessons) and not any("--" in c for c in cells), cells
        assert not index.select("article table strong")
        footer = (
            soup(f"{lang}/lessons/ddp/index.html")
            .select_one("footer p.copyright")
            .get_text(strip=True)
        )
        assert footer == (
            "© Copyright the course's authors." if lang == "en" else "© 版权归本课程的作者所有。"
        )
        for lesson in lessons:
            page = soup(f"{lang}/{lesson.page}.html")
            to_exercise = page.select(f'article p a[href="#{lang}-{lesson.slug}-exercise"]')
            assert bool(to_exercise) == bool(lesson.exercises), (lang, lesson.stem)
            assert "NBVAL_" not in page.get_text()
    assert "__len__" in soup("en/lessons/index.html").get_text()
    zh_home = soup("zh/index.html")
    labels = [a.get_text() for a in zh_home.select('article a[href^="../en/lessons/"]')]
    assert labels == ["notebook（英文）"] * len(lessons), labels
    assert "build/site/index.html" not in zh_home.get_text() + soup("en/index.html").get_text()
    ddp = soup("zh/lessons/ddp/index.html")
    assert (
        "全部导读" not in ddp.get_text()
        and "上一课：" in ddp.get_text()
        and "上一课:" not in ddp.get_text()
    )
    first = ddp.select_one("article h1").find_next("p")
    assert (
        first.find("a", string="术语对照") and first.find_next("p").find("a", string="← 02") is None
    )
    assert "时间：" in soup("zh/routes/train-on-2-8-gpus/index.html").get_text()
