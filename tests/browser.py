"""A real headless Chromium for tests, driven by Selenium through the OS's own ``chromedriver``.

The browser comes from the OS packages (``chromium`` and ``chromium-driver``;
``.ci/run`` installs them when missing): nothing is downloaded at test time,
and Selenium is always given both executables, so its manager never looks for
one. Without them a local run skips the browser tests and says why; under
``CI`` (any non-empty value) it fails, so CI can never pass without running them.
"""

from __future__ import annotations

import base64
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import require_service

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def browser_executables() -> tuple[str, str]:
    """``(browser, driver)`` paths; skips the test (fails it under CI) when either is missing."""
    browser = next((found for name in BROWSERS if (found := shutil.which(name))), None)
    driver = shutil.which("chromedriver")
    if browser and driver:
        return browser, driver
    missing = " and ".join(name for name, path in (("chromium", browser), ("chromedriver", driver)) if not path)
    require_service(missing, "the dashboard's browser tests drive it: apt-get install chromium chromium-driver (.ci/run does)")


@contextmanager
def headless_chromium(width: int = 1280, height: int = 1000) -> Iterator[object]:
    """A ``selenium`` Chrome driver on a headless Chromium window of ``width`` × ``height``; quit on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = browser_executables()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     f"--window-size={width},{height}", "--disable-extensions", "--no-first-run"):  # fmt: skip
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    try:
        yield chrome
    finally:
        chrome.quit()


def artifact_dir(tmp_path: Path) -> Path:
    """Where a test keeps what a person should look at (screenshots): ``$TIERSERVE_TEST_ARTIFACTS`` when
    set (CI keeps that folder), else the test's own temporary folder."""
    folder = Path(os.environ.get("TIERSERVE_TEST_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def save_page_screenshot(chrome, path: Path) -> Path:
    """The whole page, below the window's fold too (Chrome's own capture), as a PNG at ``path``."""
    size = chrome.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
    shot = chrome.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip})
    path.write_bytes(base64.b64decode(shot["data"]))
    return path
