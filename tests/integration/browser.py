"""Headless Debian Chromium driven by Playwright (its own browser download is not reachable here)."""
from __future__ import annotations

import shutil
from contextlib import contextmanager

# Without the background-networking flags Chromium keeps dialling Google's hosts, which this
# closed network refuses; --no-sandbox because tests run as root.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@contextmanager
def chromium():
    from playwright.sync_api import sync_playwright

    executable = shutil.which("chromium")
    if executable is None:
        raise RuntimeError("Debian's chromium is not installed: `make browser` (run by `make test`) installs it")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
