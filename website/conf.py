"""Sphinx configuration shared by both languages; website/build.py sets WEBSITE_LANG and the source folder
(build/site-src/LANG/, laid fresh from the repository's files at each build)."""

import json
import os
from pathlib import Path

LANG = os.environ.get("WEBSITE_LANG", "en")
HERE = Path(__file__).resolve().parent
STAGE = Path(os.environ.get("WEBSITE_STAGE", HERE.parent / "build" / "site-src" / LANG))

project = {
    "en": "Distributed PyTorch, one runnable lesson at a time",
    "zh": "分布式 PyTorch：一课一个可运行的脚本",
}[LANG]
html_title = "Distributed PyTorch lessons" if LANG == "en" else "分布式 PyTorch 课程"
language = "en" if LANG == "en" else "zh_CN"
# the notebooks' math (06, in both languages): MathJax vendored from its package, never from a CDN
extensions = ["myst_nb", "sphinx_design", "sphinx-mathjax-offline"]

nb_execution_mode = "off"  # the notebooks as committed: nbval validates those outputs
nb_merge_streams = False
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 4
suppress_warnings = [
    "myst.header"
]  # a guide may step from # to ###; links and references stay errors
exclude_patterns = ["_extra", "_locale", "_*.json", "jupyter_execute"]
# The Chinese notebook pages' prose (lessons/SLUG/notebook): one catalog per page, made by the gettext builder
# and kept by sphinx-intl (website/i18n.py); copied into the staging tree, where Sphinx compiles it
locale_dirs = [str(STAGE / "_locale")]
gettext_compact = False
gettext_location = False  # no line numbers in the catalogs: a moved cell is no change
gettext_uuid = False

html_theme = "pydata_sphinx_theme"
templates_path = [str(HERE / "templates")]
html_static_path = [str(HERE / "static")]
html_css_files = ["site.css"]
html_extra_path = [str(STAGE / "_extra")]  # redirects from the numbered names
html_copy_source = False
html_show_sourcelink = False
html_last_updated_fmt = None
html_search_language = "zh" if LANG == "zh" else "en"  # Chinese: words split by jieba
if LANG == "zh":  # jieba's dictionary plus the course's own terms (website/build.py, course_words)
    html_search_options = {"dict": str(STAGE / "_jieba_words.txt")}
    import logging

    import jieba

    jieba.setLogLevel(logging.WARNING)  # not its "Building prefix dict" lines at each build
html_theme_options = {
    "navbar_end": ["lang-switch", "theme-switcher"],
    "show_prev_next": False,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["site-copyright"],
    "footer_end": [],
    "navigation_with_keys": False,
}
html_sidebars = {"**": ["sidebar-nav-bs"], "index": []}
copyright = {"en": "the course's authors", "zh": "本课程的作者"}[LANG]
# the footer's line, in the page's language (the theme's own "© Copyright ..." is English on every page)
FOOTER = {"en": "© Copyright the course's authors.", "zh": "© 版权归本课程的作者所有。"}[LANG]

_other = STAGE / "_other_docnames.json"
_counterparts = STAGE / "_counterparts.json"
html_context = {
    "website_lang": LANG,
    "site_copyright": FOOTER,
    "default_mode": "auto",  # the theme logs an error on a first visit without it
    "other_docnames": set(json.loads(_other.read_text())) if _other.exists() else set(),
    # a page whose other-language page has another docname (a Chinese notebook page -> the English lesson)
    "counterparts": json.loads(_counterparts.read_text()) if _counterparts.exists() else {},
}
html_favicon = str(
    HERE / "static" / "favicon.svg"
)  # else the browser asks the host for /favicon.ico


def _fix_chinese_stemmer(app, exc):
    """Sphinx 9.0's Chinese search data names a `ChineseStemmer` it does not ship (a console error on every
    page); Chinese search stems the Latin words in Chinese text with the English stemmer it does ship."""
    path = Path(app.outdir) / "_static" / "language_data.js"
    if exc is None and LANG == "zh" and path.exists():
        text = path.read_text()
        if (
            "ChineseStemmer" in text
            and "var ChineseStemmer" not in text
            and "EnglishStemmer" in text
        ):
            text = text.replace(
                "window.Stemmer = ChineseStemmer;", "window.Stemmer = EnglishStemmer;"
            )
            path.write_text(text)


def _prose_only_in_search(app, doctree):
    """A Chinese notebook page's code cells (code and outputs, as on its English page) stay out of the
    Chinese search index: its prose is what is Chinese there, and jieba need not split the outputs."""
    if LANG == "zh" and app.env.docname.endswith("/notebook"):
        from docutils import nodes

        for node in doctree.findall(nodes.container):
            if node.get("nb_element") == "cell_code":
                node["classes"].append("no-search")


def setup(app):
    app.connect("build-finished", _fix_chinese_stemmer)
    app.connect("doctree-read", _prose_only_in_search)
