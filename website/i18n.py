"""The Chinese catalogs of the notebooks' prose: made by Sphinx's gettext builder, kept by sphinx-intl.

    python -m website.i18n update     # after an English notebook changed: refresh every catalog
    python -m website.i18n check      # what is untranslated, stale (fuzzy, obsolete) or drifted, by notebook

`update` stages each notebook's markdown cells as the Chinese site stages the notebook (website/build.py,
notebook_zh) under build/i18n/src/, runs the gettext builder on them (build/i18n/pot/), then
`sphinx-intl update`, which writes website/locale/zh_CN/LC_MESSAGES/lessons/SLUG/notebook.po: a new notebook
gets a catalog, a new paragraph an empty message, a changed paragraph its old translation marked fuzzy, a removed
one an obsolete entry. A translator fills the empty msgstr, and for a fuzzy one checks it against the new msgid
and removes the fuzzy flag. The site shows a fuzzy or empty message in English, so `check` (and
tests/site/test_translations.py) reports each one; none is allowed outside the allowlist of notebooks not yet
translated there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from website.build import CATALOGS, CONF_DIR, ROOT, Lesson, curriculum, notebook_zh, toctree

WORK = ROOT / "build" / "i18n"


def extract(work: Path = WORK) -> Path:
    """The notebooks' messages as the gettext builder finds them: work/pot/lessons/SLUG/notebook.pot."""
    src, pot = work / "src", work / "pot"
    for folder in (src, pot, work / "doctrees"):
        shutil.rmtree(folder, ignore_errors=True)
    lessons = curriculum()
    for lesson in lessons:
        target = src / f"{lesson.notebook_page}.ipynb"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(notebook_zh(lesson, lessons, prose_only=True)))
    (src / "_extra").mkdir()  # conf.py's html_extra_path, empty here
    (src / "index.md").write_text(
        "# i18n\n" + toctree([le.notebook_page for le in lessons], "index")
    )
    command = [sys.executable, "-m", "sphinx", "-b", "gettext", "-q", "-c", str(CONF_DIR)]
    # the lesson pages' anchors the notebooks link to are not in this tree: those links are no message
    command += ["-D", "suppress_warnings=myst.header,myst.xref_missing"]
    command += ["-d", str(work / "doctrees"), str(src), str(pot)]
    env = dict(os.environ, WEBSITE_LANG="zh", WEBSITE_STAGE=str(src))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    subprocess.run(command, env=env, cwd=ROOT, check=True)
    (pot / "index.pot").unlink(missing_ok=True)
    return pot


def update(work: Path = WORK) -> None:
    """Refresh every catalog from the notebooks as they are now (sphinx-intl: new, fuzzy, obsolete)."""
    pot = extract(work)
    command = [sys.executable, "-m", "sphinx_intl", "update", "-p", str(pot)]
    command += ["-d", str(CATALOGS.parent.parent), "-l", "zh_CN"]
    subprocess.run(command, cwd=ROOT, check=True)


# ---- what must match between a message and its translation ------------------------------------------------
CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
MATH = re.compile(r"\$\$.+?\$\$|\$[^$\n]+\$", re.DOTALL)
URL = re.compile(r"\]\(([^()\s]+)\)|href=\"([^\"]+)\"")
NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*(?:e-?\d+)?")


def kept_spans(text: str) -> Counter:
    """The spans a translation keeps as they are: inline code, math, link targets, and the numbers of the
    prose outside them (a number in a link or code is held by that span)."""
    spans = Counter()
    for pattern, kind in ((CODE, "code"), (MATH, "math")):
        for m in pattern.finditer(text):
            spans[f"{kind} {m.group(0)}"] += 1
        text = pattern.sub(" ", text)
    for m in URL.finditer(text):
        spans[f"link {m.group(1) or m.group(2)}"] += 1
    text = URL.sub(" ", text)
    for m in NUMBER.finditer(text):
        spans[f"number {m.group(0).replace(',', '')}"] += 1
    return spans


def drift(msgid: str, msgstr: str) -> str:
    """'' if the translation keeps the message's code, math, links and numbers; else what differs."""
    source, target = kept_spans(msgid), kept_spans(msgstr)
    if source == target:
        return ""
    lost = ", ".join(sorted((source - target).elements()))
    added = ", ".join(sorted((target - source).elements()))
    return "; ".join(
        p for p in (f"lost {lost}" if lost else "", f"added {added}" if added else "") if p
    )


# ---- the report --------------------------------------------------------------------------------------------
@dataclass
class Problem:
    stem: str  # the notebook, 03_ddp
    kind: str  # untranslated, fuzzy, obsolete, drift, no catalog
    message: str  # the English message (its start)
    detail: str = ""

    def __str__(self) -> str:
        said = self.message if len(self.message) <= 100 else self.message[:97] + "..."
        said = said.replace("\n", " ")
        return f"notebooks/{self.stem}.ipynb: {self.kind}: {said!r}" + (
            f" ({self.detail})" if self.detail else ""
        )


def read(path: Path):
    from babel.messages.pofile import read_po

    with path.open("rb") as f:
        return read_po(f)


def problems(pot: Path, lessons: list[Lesson] | None = None) -> list[Problem]:
    """Every message of the notebooks as they are now (`pot`, from `extract`) that the Chinese site cannot
    show in Chinese: no catalog, a message missing from it or untranslated, a fuzzy (stale) translation;
    every obsolete entry (a removed paragraph still kept); every translation that drifted from its message."""
    found = []
    for lesson in lessons or curriculum():
        template = read(pot / f"{lesson.notebook_page}.pot")
        if not lesson.catalog.exists():
            found.append(Problem(lesson.stem, "no catalog", str(lesson.catalog.relative_to(ROOT))))
            continue
        catalog = read(lesson.catalog)
        for message in template:
            if not message.id:
                continue
            translated = catalog.get(message.id)
            if translated is None or not translated.string:
                found.append(Problem(lesson.stem, "untranslated", message.id))
            elif translated.fuzzy:
                found.append(Problem(lesson.stem, "fuzzy", message.id))
            elif said := drift(message.id, translated.string):
                found.append(Problem(lesson.stem, "drift", message.id, said))
        for message in catalog.obsolete.values():
            found.append(Problem(lesson.stem, "obsolete", message.id))
        for message in catalog:
            if message.id and template.get(message.id) is None:
                found.append(Problem(lesson.stem, "not in the notebook", message.id, "run update"))
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m website.i18n", description=__doc__.split("\n")[0]
    )
    parser.add_argument("command", choices=("update", "check"))
    args = parser.parse_args(argv)
    if args.command == "update":
        update()
        return 0
    found = problems(extract())
    for problem in found:
        print(problem)
    counts = Counter(p.stem for p in found)
    for stem, n in sorted(counts.items()):
        print(f"{stem}: {n} messages to translate or check")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
