"""Build the course's website, English and Chinese, from the repository's own files.

    python -m website                 # both languages -> build/site/ (open build/site/index.html)
    python -m website --lang zh       # one language
    python -m website --serial        # the two languages one after the other (default: side by side)

Nothing is executed: the notebooks are shown with the outputs they were committed with (nbval checks those).
Each build first lays a fresh staging tree under build/site-src/LANG/ from the sources (copies of the
notebooks and docs with their links rewritten to the site's addresses, plus generated lesson, route and index
pages), then runs Sphinx on it with warnings as errors, so a link that does not resolve fails the build.

The Chinese site also shows each notebook with its prose in Chinese (lessons/SLUG/notebook.html): the
English notebook's markdown cells translated by Sphinx's own i18n from the catalogs in website/locale/
(kept with Sphinx's gettext builder and sphinx-intl: website/i18n.py), its code and outputs as committed.

Addresses are by topic slug (lessons/ddp/), taken from the lesson file names (lessons/03_ddp.py -> "ddp"), so
a renumbering keeps them; the numbered names (notebooks/03_ddp.html, lessons/03_ddp.html) redirect.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import html
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.run.minimal_chain import minimal_base

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = Path(__file__).resolve().parent
BUILD = ROOT / "build"
STAGE = BUILD / "site-src"
OUT = BUILD / "site"
LANGS = ("en", "zh")
# The Chinese catalogs of the notebooks' prose, one per notebook, named by its Chinese page's docname
# (website/i18n.py keeps them; gettext_compact = False in conf.py)
CATALOGS = CONF_DIR / "locale" / "zh_CN" / "LC_MESSAGES"

# Numbered names used by an earlier numbering of the curriculum, "NN_name" -> slug, so that their old
# addresses keep redirecting after a renumbering (the current numbered names redirect without an entry).
FORMER_NAMES: dict[str, str] = {
    "14_fault_tolerance": "fault-tolerance",
    "15_performance": "performance",
    "16_context_parallel": "context-parallel",
    "17_expert_parallel": "expert-parallel",
    "18_planning": "planning",
}

MINIMAL_COMMAND_RE = re.compile(r"^\s*((?:torchrun|python) .*?minimal/\S+\.py.*?)\s*(?:#.*)?$")
COMMAND_RE = re.compile(r"^\s*((?:torchrun|python) .*)$")


def slug_of(stem: str) -> str:
    """'03_ddp' -> 'ddp', '01_single_gpu' -> 'single-gpu': the lesson's name without its number."""
    return stem.split("_", 1)[1].replace("_", "-")


def assignment(path: Path, name: str):
    """The literal value assigned to `name` at the top level of the Python file `path`."""
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(getattr(t, "id", None) == name for t in targets) and node.value is not None:
            return ast.literal_eval(node.value)
    raise RuntimeError(f"{path.relative_to(ROOT)} assigns no {name}")


def exercises_table() -> dict[str, tuple[str, str]]:
    """exercises/__init__.py's EXERCISES (name -> (lesson number, what you build)), read without importing."""
    return assignment(ROOT / "exercises" / "__init__.py", "EXERCISES")


@dataclass
class Lesson:
    number: str
    stem: str  # 03_ddp
    slug: str  # ddp
    title: str = ""  # the lesson's docstring's first sentence, "Lesson NN: " left out
    title_zh: str = ""  # its Chinese guide's title, "第 NN 课导读：" left out
    topic_en: str = ""
    topic_zh: str = ""
    minimal: Path | None = None
    exercises: list[str] = field(default_factory=list)

    @property
    def page(self) -> str:
        return f"lessons/{self.slug}/index"

    @property
    def notebook_page(self) -> str:
        """The Chinese site's page of the notebook, its prose translated from its catalog."""
        return f"lessons/{self.slug}/notebook"

    @property
    def catalog(self) -> Path:
        return CATALOGS / f"{self.notebook_page}.po"

    @property
    def translated(self) -> bool:
        """Whether the notebook's catalog has a message translated: only then has it a Chinese page."""
        if not self.catalog.exists():
            return False
        from babel.messages.pofile import read_po

        with self.catalog.open("rb") as f:
            return any(m.id and m.string and not m.fuzzy for m in read_po(f))


def curriculum() -> list[Lesson]:
    lessons = []
    slugs = set()
    for path in sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py")):
        number, stem = path.stem[:2], path.stem
        lesson = Lesson(number, stem, slug_of(stem))
        if lesson.slug in slugs:
            raise RuntimeError(f"two lessons share the slug {lesson.slug!r}")
        slugs.add(lesson.slug)
        minimal = ROOT / "minimal" / f"{stem}.py"
        lesson.minimal = minimal if minimal.exists() else None
        lesson.title = first_sentence(ast.get_docstring(ast.parse(path.read_text())) or stem)
        guide = ROOT / "docs" / "zh" / "lessons" / f"{stem}.md"
        if guide.exists():
            h1 = guide.read_text().partition("\n")[0].removeprefix("# ")
            lesson.title_zh = re.sub(rf"^第\s*{number}\s*课导读[：:]\s*", "", h1).strip()
        lesson.exercises = [n for n, (num, _) in exercises_table().items() if num == number]
        lessons.append(lesson)
    for readme, attr in (("README.md", "topic_en"), ("README.zh-CN.md", "topic_zh")):
        for row in table_rows((ROOT / readme).read_text()):
            if len(row) == 5 and re.fullmatch(r"\d\d", row[0]):
                for lesson in lessons:
                    if lesson.number == row[0]:  # "[集合通信](docs/zh/lessons/...)": its text
                        setattr(lesson, attr, re.sub(r"^\[(.*)\]\([^)]*\)$", r"\1", row[1]))
    return lessons


def first_sentence(doc: str) -> str:
    """A docstring's first sentence (of its first paragraph, its lines joined), "Lesson NN: " left out and
    " -- " as a dash: "Lesson 03: DDP -- lesson 01's loop on two processes." -> "DDP — lesson 01's ..."."""
    paragraph = " ".join(line.strip() for line in doc.strip().split("\n\n")[0].splitlines())
    m = re.search(r"[.?!](?=\s|$)", paragraph)
    sentence = paragraph[: m.end()] if m else paragraph
    sentence = re.sub(r"^Lesson \d+:\s*", "", sentence).replace(" -- ", " — ")
    return sentence[:1].upper() + sentence[1:]


MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]{}<>()#+!|$~])")


def plain(text: str) -> str:
    """`text` escaped so that Markdown shows it as it is (`__len__` stays __len__, not a bold "len")."""
    return MARKDOWN_SPECIAL.sub(r"\\\1", text).replace("\n", " ")


def table_rows(markdown: str) -> list[list[str]]:
    rows = []
    for line in markdown.splitlines():
        if line.startswith("|") and not re.match(r"^\|[-| ]+\|$", line):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def routes(lang: str) -> list[dict]:
    """The README's routes by goal: [{slug, goal, lessons (numbers in order), time}]; the slug comes from the
    English goal, so both languages share it."""
    found = {}
    for la, readme in (("en", "README.md"), ("zh", "README.zh-CN.md")):
        text = (ROOT / readme).read_text()
        rows = [r for r in table_rows(text) if len(r) == 3 and re.match(r"^\d\d", r[1])]
        found[la] = rows
    if len(found["en"]) != len(found["zh"]):
        raise RuntimeError("README.md and README.zh-CN.md list different numbers of routes")
    out = []
    for en_row, row in zip(found["en"], found[lang]):
        slug = re.sub(r"[^a-z0-9]+", "-", en_row[0].lower()).strip("-")
        out.append(
            {
                "slug": slug,
                "goal": row[0],
                "cell": row[1],
                "time": row[2],
                "lessons": re.findall(r"\b(\d\d)\b", row[1]),
            }
        )
    return out


# ---- links -------------------------------------------------------------------------------------------------
LINK_RE = re.compile(r"(?<!!)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^()\s]+)\)")


class Linker:
    """Rewrites a Markdown file's links (relative to its place in the repository) to the site's pages."""

    def __init__(self, lang: str, lessons: list[Lesson], notebooks_lang: str = "en"):
        self.lang = lang
        self.notebooks_lang = (
            notebooks_lang  # a notebook's link goes to its lesson page of this language
        )
        self.by_stem = {lesson.stem: lesson for lesson in lessons}
        self.by_exercise = {name: lesson for lesson in lessons for name in lesson.exercises}
        self.pages: set[str] = set()

    def target(self, repo_path: str, anchor: str) -> tuple[str, str] | None:
        """(language, docname#anchor) of the page that shows the repository file `repo_path`."""
        p = Path(repo_path)
        parts = p.parts
        stem = p.stem
        if repo_path == "README.md":
            return "en", "index" + anchor
        if repo_path == "README.zh-CN.md":
            return "zh", "index" + anchor
        if len(parts) == 2 and parts[0] == "docs" and p.suffix == ".md":
            return "en", ("docs/index" if stem == "README" else f"docs/{stem}/index") + anchor
        if len(parts) == 3 and parts[:2] == ("docs", "zh") and p.suffix == ".md":
            return "zh", ("docs/index" if stem == "README" else f"docs/{stem}/index") + anchor
        if len(parts) == 4 and parts[:3] == ("docs", "zh", "lessons") and stem in self.by_stem:
            return "zh", self.by_stem[stem].page + anchor
        if len(parts) == 2 and parts[0] == "notebooks" and stem in self.by_stem:
            return self.notebooks_lang, self.by_stem[stem].page + anchor
        if len(parts) == 2 and parts[0] in ("minimal", "lessons") and stem in self.by_stem:
            lesson = self.by_stem[stem]
            if parts[0] == "minimal" and lesson.minimal is None:
                return None
            section = {"minimal": "minimal", "lessons": "lesson"}[parts[0]]
            return self.lang, lesson.page + (anchor or f"#@{self.lang}-{lesson.slug}-{section}")
        if len(parts) == 2 and parts[0] == "exercises" and stem in self.by_exercise:
            lesson = self.by_exercise[stem]
            return self.lang, lesson.page + (anchor or f"#@{self.lang}-{lesson.slug}-exercise")
        return None

    def rewrite(self, text: str, repo_file: str, page: str) -> str:
        """`text` of repository file `repo_file`, staged as docname `page` of this language."""
        base = Path(repo_file).parent

        def sub(m: re.Match) -> str:
            label, url = m.group(1), m.group(2)
            if re.match(r"^[a-z]+:", url) or url.startswith("mailto:"):
                return m.group(0)
            path, _, anchor = url.partition("#")
            anchor = "#" + anchor if anchor else ""
            if not path:
                return m.group(0)  # an anchor on the same page
            repo_path = os.path.normpath(base / path).replace(os.sep, "/")
            found = self.target(repo_path, anchor)
            if found is None:
                return (
                    f"{label} (`{repo_path}`)"
                    if "`" not in label and repo_path not in label
                    else label
                )
            lang, doc = found
            doc, _, anchor = doc.partition("#")
            if lang == self.lang and anchor.startswith("@"):
                return f"[{label}](#{anchor[1:]})"
            anchor = anchor.lstrip("@")
            if lang == self.lang:
                return f"[{label}]({md_link(lang, page, doc)}{'#' + anchor if anchor else ''})"
            href = cross_href(page, lang, doc) + ("#" + anchor if anchor else "")
            return f'<a href="{href}">{inline_html(label)}</a>'

        return LINK_RE.sub(sub, text)


def suffix(lang: str, doc: str) -> str:
    """The staged file's suffix of docname `doc`: an English lesson page is its notebook, and so is a
    Chinese notebook page."""
    lesson_page = re.fullmatch(r"lessons/[^/]+/index", doc) and doc != "lessons/index"
    notebook_page = re.fullmatch(r"lessons/[^/]+/notebook", doc)
    return ".ipynb" if (lang == "en" and lesson_page) or notebook_page else ".md"


def md_link(lang: str, page: str, doc: str) -> str:
    """The Markdown link target, from docname `page`, of docname `doc` of the same language."""
    return os.path.relpath(doc, Path(page).parent).replace(os.sep, "/") + suffix(lang, doc)


def cross_href(page: str, lang: str, doc: str) -> str:
    """The relative address, from docname `page` of one language, of docname `doc` of language `lang`."""
    return "../" * (page.count("/") + 1) + f"{lang}/{doc}.html"


def inline_html(label: str) -> str:
    parts = re.split(r"`([^`]*)`", label)
    return "".join(
        f"<code>{html.escape(p)}</code>" if i % 2 else html.escape(p) for i, p in enumerate(parts)
    )


# ---- lesson pages ------------------------------------------------------------------------------------------
def fence(code: str, lang: str = "python") -> str:
    ticks = "`" * max(3, max((len(m) for m in re.findall(r"`+", code)), default=0) + 1)
    return f"{ticks}{lang}\n{code.rstrip()}\n{ticks}\n"


def dropdown(title: str, body: str) -> str:
    colons = ":" * max(
        3, max((len(m) for m in re.findall(r"^:{3,}", body, re.MULTILINE)), default=0) + 1
    )
    return f"{colons}{{dropdown}} {title}\n{body.rstrip()}\n{colons}\n"


def docstring_commands(source: str) -> list[str]:
    doc = ast.get_docstring(ast.parse(source)) or ""
    commands, pending = [], ""
    for line in doc.splitlines():
        if pending:
            pending += "\n" + line
            if not line.rstrip().endswith("\\"):
                commands.append(pending)
                pending = ""
            continue
        m = COMMAND_RE.match(line)
        if m and line.startswith("    "):
            if line.rstrip().endswith("\\"):
                pending = line.strip()
            else:
                commands.append(m.group(1).rstrip())
    return commands


def claims(source: str) -> list[tuple[str, str, str, str]]:
    """(name, relation, bound, sentence) of every report.claim(...) call in a lesson's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "claim"
            and len(node.args) >= 4
        ):
            args = [a.value if isinstance(a, ast.Constant) else ast.unparse(a) for a in node.args]
            sentence = template_text(node.args[4]) if len(node.args) > 4 else ""
            found.append((str(args[0]), str(args[2]), str(args[3]), sentence))
    found.sort(key=lambda c: c[0])
    return found


def template_text(node: ast.expr) -> str:
    """A claim's sentence as its source writes it: a string as is, an f-string with its fields in braces, a
    sentence built elsewhere in the lesson as a dash."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
            for v in node.values
        )
    return "–"


def cell_text(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


WORDS = {
    "en": {
        "minimal": "Minimal script",
        "lesson": "Measured lesson",
        "exercise": "Exercise",
        "nav": "Previous and next",
        "prev": "Previous",
        "next": "Next",
        "none_min": "This lesson has no minimal script: read the measured lesson's docstring below.",
        "diff": "The diff from its base, `{base}`:",
        "whole": "The whole script, `{path}` ({n} lines)",
        "run": "Run it:",
        "source": "The source, `{path}` ({n} lines)",
        "commands": "The commands from its docstring:",
        "claims": "What it measures: each claim below is printed "
        "with its bound, recorded, and asserted by a test.",
        "claim_head": "| claim | holds when | printed as |",
        "stub": "The stub, `exercises/{name}.py`: {what}.",
        "grade": "Fill it in, then grade it (2-4 gloo processes, compared with PyTorch's own):",
        "solution": "The solution, `exercises/solutions/{name}.py` (open it after your own attempt)",
        "no_ex": "This lesson has no exercise.",
        "guide": "中文导读",
        "notebook": None,
        "start": "Start of the course",
        "end": "End of the course",
        "colon": ": ",
    },
    "zh": {
        "minimal": "最小脚本",
        "lesson": "课程文件",
        "exercise": "练习",
        "nav": "上一课与下一课",
        "prev": "上一课",
        "next": "下一课",
        "none_min": "这一课没有最小脚本：读下面课程文件开头的 docstring。",
        "diff": "与基础脚本 `{base}` 的差别：",
        "whole": "完整脚本 `{path}`（{n} 行）",
        "run": "运行：",
        "source": "源码 `{path}`（{n} 行）",
        "commands": "docstring 里的命令：",
        "claims": "它测量什么：下面每个结论都连同界限一起打印、记录，并由测试断言。",
        "claim_head": "| 结论 | 成立条件 | 打印为 |",
        "stub": "练习文件 `exercises/{name}.py`：{what}。",
        "grade": "填好之后评分（2-4 个 gloo 进程，与 PyTorch 自己的实现比较）：",
        "solution": "参考答案 `exercises/solutions/{name}.py`（先自己做完再看）",
        "no_ex": "这一课没有练习。",
        "guide": None,
        "notebook": "notebook（英文）",
        "notebook_zh": "notebook（中文）",
        "guide_zh": "导读",
        "start": "课程开始",
        "end": "课程结束",
        "colon": "：",
    },
}


def lesson_sections(lesson: Lesson, lessons: list[Lesson], lang: str, page: str) -> str:
    w = WORDS[lang]
    out = [f"\n({lang}-{lesson.slug}-minimal)=\n## {w['minimal']}\n"]
    if lesson.minimal is None:
        out.append(w["none_min"] + "\n")
    else:
        source = lesson.minimal.read_text()
        rel = f"minimal/{lesson.minimal.name}"
        commands = [
            m.group(1)
            for line in (ast.get_docstring(ast.parse(source)) or "").splitlines()
            if (m := MINIMAL_COMMAND_RE.match(line))
        ]
        out.append(w["run"] + "\n\n" + fence("\n".join(commands), "bash"))
        base_number = minimal_base(lesson.number)
        base = next((le for le in lessons if le.number == base_number and le.minimal), None)
        if base is not None:
            diff = "\n".join(
                difflib.unified_diff(
                    base.minimal.read_text().splitlines(),
                    source.splitlines(),
                    f"minimal/{base.minimal.name}",
                    rel,
                    n=1,
                    lineterm="",
                )
            )
            said = w["diff"].format(base=f"minimal/{base.minimal.name}")
            out.append("\n" + said + "\n\n" + fence(diff, "diff"))
        n = len(source.splitlines())
        out.append("\n" + dropdown(w["whole"].format(path=rel, n=n), fence(source)))
    out.append(f"\n({lang}-{lesson.slug}-lesson)=\n## {w['lesson']}\n")
    source = (ROOT / "lessons" / f"{lesson.stem}.py").read_text()
    commands = docstring_commands(source)
    if commands:
        out.append(w["commands"] + "\n\n" + fence("\n".join(commands), "bash"))
    found = claims(source)
    if found:
        out.append("\n" + w["claims"] + "\n\n" + w["claim_head"] + "\n|---|---|---|\n")
        for name, rel_, bound, sentence in found:
            holds = f"{cell_text(rel_)} {cell_text(bound)}"
            out.append(f"| `{cell_text(name)}` | `{holds}` | {cell_text(sentence)} |\n")
    rel = f"lessons/{lesson.stem}.py"
    out.append(
        "\n" + dropdown(w["source"].format(path=rel, n=len(source.splitlines())), fence(source))
    )
    out += exercises_and_neighbours(lesson, lessons, lang, page)
    return "".join(out)


def exercises_and_neighbours(
    lesson: Lesson, lessons: list[Lesson], lang: str, page: str
) -> list[str]:
    """A lesson page's last sections: its exercises (stub, how to grade, solution) and the lessons before
    and after it."""
    w, out = WORDS[lang], []
    out.append(f"\n({lang}-{lesson.slug}-exercise)=\n## {w['exercise']}\n")
    if not lesson.exercises:
        out.append(w["no_ex"] + "\n")
    table = exercises_table()
    for name in lesson.exercises:
        stub = (ROOT / "exercises" / f"{name}.py").read_text()
        solution = (ROOT / "exercises" / "solutions" / f"{name}.py").read_text()
        out.append(w["stub"].format(name=name, what=table[name][1]) + "\n\n" + fence(stub))
        out.append("\n" + w["grade"] + "\n\n" + fence(f"python -m exercises {name}", "bash"))
        out.append("\n" + dropdown(w["solution"].format(name=name), fence(solution)))
    i = lessons.index(lesson)
    out.append(f"\n## {w['nav']}\n\n")
    prev_ = lessons[i - 1] if i else None
    next_ = lessons[i + 1] if i + 1 < len(lessons) else None
    for word, other, edge in (("prev", prev_, "start"), ("next", next_, "end")):
        if other is None:
            out.append(f"- {w[word]}{w['colon']}{w[edge]}\n")
        else:
            topic = other.topic_zh if lang == "zh" else other.topic_en
            link = md_link(lang, page, other.page)
            out.append(f"- {w[word]}{w['colon']}[{other.number} {topic}]({link})\n")
    return out


def nav_line(lesson: Lesson, lessons: list[Lesson], lang: str, page: str) -> str:
    """The line under a lesson's title: its place, the neighbours, its sections (the exercise where it has
    one), the other language's page."""
    i = lessons.index(lesson)
    w = WORDS[lang]
    bits = []
    if i:
        bits.append(f"[← {lessons[i - 1].number}]({md_link(lang, page, lessons[i - 1].page)})")
    if i + 1 < len(lessons):
        bits.append(f"[{lessons[i + 1].number} →]({md_link(lang, page, lessons[i + 1].page)})")
    parts = ("minimal", "lesson", "exercise") if lesson.exercises else ("minimal", "lesson")
    bits += [f"[{w[part]}](#{lang}-{lesson.slug}-{part})" for part in parts]
    if page == lesson.notebook_page:  # the Chinese notebook page: back to the lesson's guide
        bits.append(f"[{w['guide_zh']}]({md_link(lang, page, lesson.page)})")
    elif lang == "zh" and lesson.translated:
        bits.append(f"[{w['notebook_zh']}]({md_link(lang, page, lesson.notebook_page)})")
    if w["notebook"]:
        bits.append(f'<a href="{cross_href(page, "en", lesson.page)}">{w["notebook"]}</a>')
    return " · ".join(bits) + "\n"


# ---- staging -----------------------------------------------------------------------------------------------
WORD = {
    "en": ("Lessons", "Routes by goal", "Reference", "Lesson", "topic", "time: ", "what it covers"),
    "zh": ("课程", "按目标的路线", "参考页", "课", "主题", "时间：", "内容"),
}


def write_json_notebook(target: Path, nb: dict) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(nb, ensure_ascii=False))


def with_nav_cell(nb: dict, nav: str) -> None:
    """The site's navigation line as a Markdown cell after the notebook's first Markdown cell."""
    first = next(i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown")
    nav_cell = {"cell_type": "markdown", "id": "site-nav", "metadata": {}, "source": nav}
    nb["cells"].insert(first + 1, nav_cell)


def doc_pages(lang: str, linker: Linker, pages: dict[str, str]) -> None:
    """The reference pages of docs/ (docs/zh/ in Chinese) into `pages`, with their toctree."""
    docs = ROOT / "docs" if lang == "en" else ROOT / "docs" / "zh"
    found = []
    for path in sorted(docs.glob("*.md")):
        repo = path.relative_to(ROOT).as_posix()
        doc = "docs/index" if path.stem == "README" else f"docs/{path.stem}/index"
        pages[doc] = linker.rewrite(path.read_text(), repo, doc)
        if doc != "docs/index":
            found.append(doc)
    pages["docs/index"] += toctree(found, "docs/index")


def english_lesson(lesson: Lesson, lessons: list[Lesson], linker: Linker, src: Path) -> None:
    """An English lesson page: its notebook, links rewritten, nbval markers dropped, with the site's
    navigation after its title and the minimal script, lesson and exercise sections at its end."""
    page = lesson.page
    nb = json.loads((ROOT / "notebooks" / f"{lesson.stem}.ipynb").read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            text = linker.rewrite("".join(cell["source"]), f"notebooks/{lesson.stem}.ipynb", page)
            cell["source"] = text
        elif cell["cell_type"] == "code":
            cell["source"] = without_nbval_markers("".join(cell["source"]))
    guide = cross_href(page, "zh", page)
    nav = nav_line(lesson, lessons, "en", page).rstrip("\n") + f' · <a href="{guide}">中文导读</a>'
    if lesson.translated:
        zh_notebook = cross_href(page, "zh", lesson.notebook_page)
        nav += f' · <a href="{zh_notebook}">中文 notebook</a>'
    with_nav_cell(nb, nav + "\n")
    sections = lesson_sections(lesson, lessons, "en", page)
    nb["cells"].append(
        {"cell_type": "markdown", "id": "site-sections", "metadata": {}, "source": sections}
    )
    write_json_notebook(src / f"{page}.ipynb", nb)


def chinese_lesson(lesson, lessons, linker: Linker, src: Path, pages, counterparts) -> None:
    """A Chinese lesson page: its guide (docs/zh/lessons/), the site's navigation, the sections; and its
    Chinese notebook where the lesson has one."""
    page = lesson.page
    repo = f"docs/zh/lessons/{lesson.stem}.md"
    title, _, rest = (ROOT / repo).read_text().partition("\n")
    rest, extra = without_link_paragraph(rest)  # the generated line below the title replaces it
    text = linker.rewrite(title + "\n\n" + extra + "\n" + rest, repo, page)
    title, _, text = text.partition("\n\n")
    extra, _, rest = text.partition("\n")
    nav = nav_line(lesson, lessons, "zh", page).rstrip("\n") + (" · " + extra if extra else "")
    sections = lesson_sections(lesson, lessons, "zh", page)
    pages[page] = title + "\n\n" + nav + "\n\n" + rest + sections
    if lesson.translated:
        pages[page] += toctree([lesson.notebook_page], page)
        notebook = notebook_zh(lesson, lessons)
        with_nav_cell(notebook, nav_line(lesson, lessons, "zh", lesson.notebook_page))
        write_json_notebook(src / f"{lesson.notebook_page}.ipynb", notebook)
        counterparts[lesson.notebook_page] = lesson.page


def lessons_index(lang: str, lessons: list[Lesson], pages: dict[str, str]) -> None:
    word = WORD[lang]
    lines = [f"# {word[0]}\n\n| # | {word[4]} | {word[6]} |\n|---|---|---|\n"]
    for lesson in lessons:
        topic = lesson.topic_zh if lang == "zh" else lesson.topic_en
        link = md_link(lang, "lessons/index", lesson.page)
        lines.append(f"| {lesson.number} | [{topic}]({link}) | {plain(summary(lesson, lang))} |\n")
    pages["lessons/index"] = "".join(lines) + toctree([le.page for le in lessons], "lessons/index")


def route_pages(lang: str, lessons: list[Lesson], linker: Linker, readme: str, pages) -> None:
    """A page for each route by goal (README's table) and their index."""
    word, found = WORD[lang], []
    by_number = {lesson.number: lesson for lesson in lessons}
    lines = [f"# {word[1]}\n\n"]
    colon, comma = (": ", ", ") if lang == "en" else ("：", "，")
    for route in routes(lang):
        page = f"routes/{route['slug']}/index"
        found.append(page)
        cell = linker.rewrite(route["cell"], readme, page)
        body = [f"# {route['goal']}\n\n{cell}\n\n{word[5]}{route['time']}\n\n"]
        for n in route["lessons"]:
            lesson = by_number[n]
            topic = lesson.topic_zh if lang == "zh" else lesson.topic_en
            link = md_link(lang, page, lesson.page)
            said = summary(lesson, lang)  # a Chinese guide's title may be its topic: not said twice
            body.append(
                f"1. [{n} {topic}]({link})" + (colon + plain(said) if said != topic else "") + "\n"
            )
        pages[page] = "".join(body)
        # the route's own link added after
        cell = linker.rewrite(route["cell"], readme, "routes/index")
        lines.append(
            f"- [{route['goal']}]({route['slug']}/index.md){colon}{cell}{comma}{route['time']}\n"
        )
    pages["routes/index"] = "".join(lines) + toctree(found, "routes/index")


def write_extras(lang: str, lessons: list[Lesson], src: Path, pages, counterparts) -> None:
    """Redirects from the numbered names (html_extra_path), the Chinese search words, the docnames and
    counterparts the build reads, and the compiled catalogs' source."""
    extra = src / "_extra"
    names = {lesson.stem: lesson.slug for lesson in lessons} | FORMER_NAMES
    for stem, slug in names.items():
        for folder in ("lessons", "notebooks"):
            target = extra / folder / f"{stem}.html"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(redirect_page(f"../lessons/{slug}/index.html"))
    if lang == "zh":
        (src / "_jieba_words.txt").write_text("".join(f"{w} 1000\n" for w in course_words()))
    (src / "_docnames.json").write_text(
        json.dumps(sorted([p for p in pages] + [lesson.page for lesson in lessons]))
    )
    (src / "_counterparts.json").write_text(json.dumps(counterparts))
    # the catalogs, where Sphinx compiles them (not in the tree)
    if lang == "zh" and CATALOGS.exists():
        shutil.copytree(CATALOGS.parent.parent, src / "_locale")


def stage(lang: str, lessons: list[Lesson], staging: Path = STAGE) -> Path:
    """Lay build/site-src/LANG/ afresh from the repository's files; returns it."""
    src = staging / lang
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    linker = Linker(lang, lessons)
    pages: dict[str, str] = {}  # docname -> its text (Markdown), for what is not a notebook
    counterparts: dict[str, str] = {}  # docname -> the other language's page, where not the same
    readme = "README.md" if lang == "en" else "README.zh-CN.md"
    home = linker.rewrite(home_source((ROOT / readme).read_text(), lang), readme, "index")
    if lang == "zh":
        home = with_chinese_notebooks(home, lessons)
    pages["index"] = link_route_goals(home, lang)
    doc_pages(lang, linker, pages)
    for lesson in lessons:
        if lang == "en":
            english_lesson(lesson, lessons, linker, src)
        else:
            chinese_lesson(lesson, lessons, linker, src, pages, counterparts)
    lessons_index(lang, lessons, pages)
    route_pages(lang, lessons, linker, readme, pages)
    pages["index"] += toctree(["lessons/index", "routes/index", "docs/index"], "index")
    for doc, text in pages.items():
        target = src / f"{doc}.md"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    write_extras(lang, lessons, src, pages, counterparts)
    return src


def notebook_zh(lesson: Lesson, lessons: list[Lesson], prose_only: bool = False) -> dict:
    """The lesson's notebook as the Chinese site stages it at lesson.notebook_page (its markdown to be
    translated by Sphinx from the catalog): links rewritten for that page, a notebook's link to its Chinese
    lesson page, no nbval markers. `prose_only`: the markdown cells alone, what the catalogs are made from
    (website/i18n.py); the messages are the same, as the code cells and outputs hold none."""
    nb = json.loads((ROOT / "notebooks" / f"{lesson.stem}.ipynb").read_text())
    linker = Linker("zh", lessons, notebooks_lang="zh")
    cells = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            repo = f"notebooks/{lesson.stem}.ipynb"
            cell["source"] = linker.rewrite("".join(cell["source"]), repo, lesson.notebook_page)
        elif prose_only:
            continue
        elif cell["cell_type"] == "code":
            cell["source"] = without_nbval_markers("".join(cell["source"]))
        cells.append(cell)
    nb["cells"] = cells
    return nb


def summary(lesson: Lesson, lang: str) -> str:
    """What a lesson covers, in a lesson list: its docstring's first sentence, or its Chinese guide's
    title."""
    return (lesson.title_zh or lesson.topic_zh) if lang == "zh" else lesson.title


def home_source(text: str, lang: str) -> str:
    """The README as the site's home page: without its first paragraph under the title where that paragraph
    points at the other README and at the website (on the site, the language switch and the site itself);
    in Chinese, the lesson table's notebooks labelled as English (study_cells_zh)."""
    title, _, rest = text.partition("\n\n")
    first, _, after = rest.partition("\n\n")
    if "build/site/index.html" in first and "README" in first:
        text = title + "\n\n" + after
    return study_cells_zh(text) if lang == "zh" else text


def link_route_goals(home: str, lang: str) -> str:
    """The home page's routes table, each goal a link to its route page."""
    lines = home.split("\n")
    for route in routes(lang):
        head = f"| {route['goal']} |"
        link = md_link(lang, "index", f"routes/{route['slug']}/index")
        for i, line in enumerate(lines):
            if line.startswith(head):
                lines[i] = f"| [{route['goal']}]({link}) |" + line[len(head) :]
    return "\n".join(lines)


def study_cells_zh(text: str) -> str:
    """README.zh-CN.md's lesson table, its 学 column: the notebook says it is in English, and the lesson's
    Chinese guide stands beside it."""

    def sub(m: re.Match) -> str:
        stem = m.group(2)
        guide = f"docs/zh/lessons/{stem}.md"
        guide = f"[导读]({guide}) · " if (ROOT / guide).exists() else ""
        return f"| {guide}[notebook（英文）](notebooks/{stem}.ipynb)"

    return re.sub(r"\| \[(\d\d_\w+)\]\(notebooks/(\1)\.ipynb\)", sub, text)


def with_chinese_notebooks(home: str, lessons: list[Lesson]) -> str:
    """The Chinese home page's lesson table (its links rewritten): beside each English notebook, the
    notebook's Chinese page where its catalog is translated."""
    for lesson in lessons:
        if lesson.translated:
            english = (
                f'<a href="{cross_href("index", "en", lesson.page)}">{WORDS["zh"]["notebook"]}</a>'
            )
            chinese = (
                f"[{WORDS['zh']['notebook_zh']}]({md_link('zh', 'index', lesson.notebook_page)})"
            )
            home = home.replace(english, f"{english} · {chinese}")
    return home


NBVAL_MARKER = re.compile(r"^[ \t]*#[ \t]*NBVAL_[A-Z_]+[ \t]*(?:\n|$)", re.MULTILINE)


def without_nbval_markers(source: str) -> str:
    """A code cell's source without nbval's marker comments (# NBVAL_IGNORE_OUTPUT), which are for the
    tests, not the reader."""
    return NBVAL_MARKER.sub("", source)


def without_link_paragraph(text: str) -> tuple[str, str]:
    """A Chinese guide's body (after its title) without its first paragraph of links, which the generated
    line under the title replaces; returns (the rest, the links it has that the line has not: the glossary,
    the symptom index), the links as " · "-joined Markdown."""
    lead, _, rest = text.lstrip("\n").partition("\n\n")
    links = LINK_RE.findall(lead)
    if not links or re.sub(r"[\s·]", "", LINK_RE.sub("", lead)):
        return text, ""
    kept = [
        f"[{label}]({url})"
        for label, url in links
        if not re.match(r"^(\.\./)+(README\.md|lessons/|minimal/|notebooks/)", url)
    ]
    return rest, " · ".join(kept)


CJK = re.compile(r"^[\u4e00-\u9fff]{3,8}$")


def course_words() -> list[str]:
    """The course's Chinese terms, for jieba (the Chinese search's word splitter): the 中文 column of the
    Chinese glossary and the bold terms that open the items of each guide's 术语 list, split at their separators
    ("梯度累积 / 梯度累加（gradient accumulation）"). jieba's own dictionary cuts 梯度累积 into 梯度 + 累积,
    so without these a search for the whole term finds nothing."""
    glossary = table_rows((ROOT / "docs" / "zh" / "glossary.md").read_text())
    spans = [row[1] for row in glossary if len(row) >= 3]
    for path in sorted((ROOT / "docs" / "zh" / "lessons").glob("*.md")):
        spans += re.findall(r"^- \*\*([^*]+)\*\*", path.read_text(), re.MULTILINE)
    words = set()
    for span in spans:
        words.update(
            w
            for w in re.split(r"[\s/、，,。：:（）()“”\[\]`·]+|[A-Za-z0-9_.\-]+", span)
            if CJK.match(w)
        )
    return sorted(words)


def toctree(docs: list[str], page: str) -> str:
    rels = [os.path.relpath(d, Path(page).parent).replace(os.sep, "/") for d in docs]
    return "\n\n```{toctree}\n:hidden:\n:maxdepth: 1\n\n" + "\n".join(rels) + "\n```\n"


def redirect_page(href: str) -> str:
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>Moved</title>\n'
        f'<link rel="canonical" href="{href}">\n<meta http-equiv="refresh" content="0; url={href}">\n'
        f'</head><body><p>This page moved to <a href="{href}">{href}</a>.</p></body></html>\n'
    )


# ---- building ----------------------------------------------------------------------------------------------
def build(langs=LANGS, serial: bool = False, out: Path = OUT, staging: Path = STAGE) -> float:
    """Stage and build `langs` into out/LANG/; returns the seconds taken. Everything is laid fresh: the
    staging tree, Sphinx's environment (doctrees) and the output, so a changed source always shows."""
    t0 = time.perf_counter()
    lessons = curriculum()
    for (
        lang
    ) in LANGS:  # both staged: each build knows the other language's pages, for its language switch
        stage(lang, lessons, staging)
    for lang in LANGS:
        other = "zh" if lang == "en" else "en"
        shutil.copy(staging / other / "_docnames.json", staging / lang / "_other_docnames.json")
    doctrees = staging.parent / (staging.name + "-doctrees")
    for lang in langs:
        shutil.rmtree(out / lang, ignore_errors=True)
        shutil.rmtree(doctrees / lang, ignore_errors=True)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    procs = []
    failed = []
    for lang in langs:
        command = [
            sys.executable,
            "-m",
            "sphinx",
            "-b",
            "html",
            "-W",
            "--keep-going",
            "-q",
            "-c",
            str(CONF_DIR),
            "-d",
            str(doctrees / lang),
            str(staging / lang),
            str(out / lang),
        ]
        proc = subprocess.Popen(
            command, env=dict(env, WEBSITE_LANG=lang, WEBSITE_STAGE=str(staging / lang)), cwd=ROOT
        )
        if serial:
            if proc.wait():
                failed.append(lang)
        else:
            procs.append((lang, proc))
    for lang, proc in procs:
        if proc.wait():
            failed.append(lang)
    if failed:
        raise SystemExit(f"error: the {', '.join(failed)} site did not build (warnings are errors)")
    shutil.rmtree(
        out / "jupyter_execute", ignore_errors=True
    )  # myst-nb's scratch folder, not a page
    for lang in langs:
        shutil.rmtree(out / lang / "_sources", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "index.html").write_text(redirect_page("en/index.html"))
    (out / ".nojekyll").write_text("")
    return time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m website", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lang", choices=LANGS, action="append", help="default: both")
    parser.add_argument(
        "--serial", action="store_true", help="build the languages one after the other"
    )
    args = parser.parse_args(argv)
    seconds = build(tuple(args.lang or LANGS), args.serial)
    print(f"site built in {seconds:.1f} s: {OUT / 'index.html'}")
    return 0
