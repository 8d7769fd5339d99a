"""The website built once for the session's site tests, served on 127.0.0.1, and one headless Chromium.

Debian's /usr/bin/chromium is driven through Selenium with /usr/bin/chromedriver (no browser download). Under
CI (CI=true) a missing browser or site package fails the tests; elsewhere they skip with one line naming the
install command. Screenshots go to build/site-screenshots/ (or $SITE_ARTIFACTS).
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
APT = "apt-get install chromium chromium-driver fonts-noto-cjk"
PIP = "pip install -r requirements-site.txt"
ARTIFACTS = Path(os.environ.get("SITE_ARTIFACTS", ROOT / "build" / "site-screenshots"))


def missing(what: str, how: str):
    message = f"{what} missing: {how}"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def need_site_packages():
    for module in ("sphinx", "myst_nb", "pydata_sphinx_theme", "sphinx_design", "jieba", "bs4"):
        if importlib.util.find_spec(module) is None:
            missing(f"the site's Python package {module}", PIP)


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    """The built site (both languages), built once per session from the sources as they are now."""
    need_site_packages()
    from website.build import build

    root = tmp_path_factory.mktemp("website")
    out = root / "site"
    seconds = build(out=out, staging=root / "site-src")
    print(f"site built in {seconds:.1f} s: {out}")
    return out


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="session")
def server(site):
    """The site served on 127.0.0.1 (a free port), as a static host would serve it."""
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site))
    )
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium for the session, logging its console and network events."""
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        missing("chromium or chromedriver", APT)
    if importlib.util.find_spec("selenium") is None:
        missing("selenium", PIP)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,900",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-default-apps",
        "--lang=en-US",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()
