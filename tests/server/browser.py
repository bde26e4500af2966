"""A real headless Chromium (Debian's `chromium`) driven by Playwright, for the console
tests. Never `playwright install`: the system browser is launched by path. Tests that
need it skip with one line when it (or Playwright) is missing; `.ci/run` installs it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.system import system_missing

CHROMIUM = os.environ.get("PIPESERVE_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
VIEWPORT = {"width": 1280, "height": 800}


def browser_or_skip() -> Iterator[Any]:
    """A launched Chromium (closed afterwards), or a skip saying what is missing."""
    if not Path(CHROMIUM).exists() and not shutil.which("chromium"):
        system_missing(f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run does)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        system_missing("playwright is not installed (pip install -e '.[test]')")
    executable = CHROMIUM if Path(CHROMIUM).exists() else str(shutil.which("chromium"))
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


def screenshot_dir(fallback: Path) -> Path:
    """Where the tests save screenshots: PIPESERVE_SCREENSHOTS (docs/images to refresh
    the README's pictures), else the test's temporary folder."""
    folder = Path(os.environ.get("PIPESERVE_SCREENSHOTS") or fallback)
    folder.mkdir(parents=True, exist_ok=True)
    return folder
