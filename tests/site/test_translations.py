"""The Chinese catalogs of the notebooks' prose (website/i18n.py), against the notebooks as they are now: every
message of every notebook translated, none stale (fuzzy, obsolete, or a paragraph the notebook no longer has),
each translation keeping its message's inline code, math, link targets and numbers. A notebook not yet
translated is named in NOT_YET_TRANSLATED, which only shrinks: a new notebook fails here until it is
translated or named there. To fix a failure: `python -m website.i18n update`, then translate what
`python -m website.i18n check` lists."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.site.conftest import need_site_packages
from tests.site.test_staging import copy_sources
from website import build as site_build
from website import i18n

# Notebooks whose Chinese page is not done yet (their stems): the lead shrinks this as they are translated.
# A new notebook fails the test above until its catalog is translated or its stem is named here.
NOT_YET_TRANSLATED: set[str] = set()


@pytest.fixture(scope="module")
def problems(tmp_path_factory) -> list[i18n.Problem]:
    need_site_packages()
    return i18n.problems(i18n.extract(tmp_path_factory.mktemp("i18n")))


def test_every_notebook_message_is_translated_and_current(problems):
    found = [p for p in problems if p.stem not in NOT_YET_TRANSLATED]
    assert not found, (
        f"{len(found)} messages of the notebooks have no current Chinese translation "
        "(python -m website.i18n update, then translate them in website/locale/):\n"
        + "\n".join(map(str, found))
    )


def test_the_allowlist_names_only_notebooks_not_yet_translated(problems):
    stems = {lesson.stem for lesson in site_build.curriculum()}
    unknown = sorted(NOT_YET_TRANSLATED - stems)
    done = sorted(s for s in NOT_YET_TRANSLATED & stems if not any(p.stem == s for p in problems))
    assert not unknown, f"NOT_YET_TRANSLATED names notebooks that do not exist: {unknown}"
    assert not done, f"translated now, take them out of NOT_YET_TRANSLATED: {done}"


def test_a_translation_keeps_code_math_links_and_numbers():
    msgid = "Run `torchrun --nproc_per_node=2` on 4 ranks, $2(N-1)/N$, see [the guide](a.md)."
    assert (
        i18n.drift(
            msgid, "在 4 个 rank 上运行 `torchrun --nproc_per_node=2`，$2(N-1)/N$，见[指南](a.md)。"
        )
        == ""
    )
    assert "lost code `torchrun --nproc_per_node=2`" in i18n.drift(
        msgid, "在 4 个 rank 上运行 torchrun，$2(N-1)/N$，见[指南](a.md)。"
    )
    assert "lost number 4; added number 8" in i18n.drift(
        msgid, "在 8 个 rank 上运行 `torchrun --nproc_per_node=2`，$2(N-1)/N$，见[指南](a.md)。"
    )
    assert "lost link a.md" in i18n.drift(
        msgid, "在 4 个 rank 上运行 `torchrun --nproc_per_node=2`，$2(N-1)/N$，见指南。"
    )
    assert "lost math" in i18n.drift(
        msgid, "在 4 个 rank 上运行 `torchrun --nproc_per_node=2`，见[指南](a.md)。"
    )


def test_a_changed_paragraph_makes_its_translation_stale(tmp_path, monkeypatch):
    """sphinx-intl marks a changed paragraph's translation fuzzy and keeps a removed one as obsolete; the
    check reports both, and the new paragraph as untranslated where it is new."""
    need_site_packages()
    sources = tmp_path / "repo"
    sources.mkdir()
    copy_sources(sources)
    catalogs = sources / "website" / "locale" / "zh_CN" / "LC_MESSAGES"
    shutil.copytree(site_build.CATALOGS, catalogs)
    for module in (site_build, i18n):
        monkeypatch.setattr(module, "ROOT", sources)
        monkeypatch.setattr(module, "CATALOGS", catalogs)
    lesson = next(le for le in site_build.curriculum() if le.stem not in NOT_YET_TRANSLATED)
    path = sources / "notebooks" / f"{lesson.stem}.ipynb"
    nb = json.loads(path.read_text())
    markdown = [c for c in nb["cells"] if c["cell_type"] == "markdown"]
    changed, removed = markdown[0], markdown[-1]
    first = next(p for p in "".join(changed["source"]).split("\n\n") if p[:1].isalpha())
    changed["source"] = "".join(changed["source"]).replace(first, first + " One more sentence.", 1)
    removed_text = "".join(removed["source"])
    nb["cells"].remove(removed)
    path.write_text(json.dumps(nb))

    i18n.update(tmp_path / "work")
    found = [p for p in i18n.problems(i18n.extract(tmp_path / "work")) if p.stem == lesson.stem]
    kinds = {(p.kind, p.message) for p in found}
    changed_message = " ".join((first + " One more sentence.").split())  # a message is one line
    assert ("fuzzy", changed_message) in kinds, found
    assert any(k == "obsolete" and m in removed_text for k, m in kinds), found
    assert {p.kind for p in found} <= {"fuzzy", "obsolete", "untranslated"}, found
