"""Debian's Chromium driven by Playwright, logged in to Airflow as its admin: the monitoring
pages' end-to-end checks (bin/setup --browser installs the browser)."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ipcount.rules.config import STATE_DIR
from ipcount_lab.embedded_airflow import admin_password

CHROMIUM = "/usr/bin/chromium"
# Screenshots the tests take (CI keeps them); docs/monitor-epochs.png is one of them.
ARTIFACTS = Path(os.environ.get("IPCOUNT_TEST_ARTIFACTS", STATE_DIR / "test-artifacts"))


@contextmanager
def browser_page() -> Iterator:
    """A fresh page in headless Chromium, 1600 x 1000."""
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "Debian's chromium is needed (bin/setup --browser installs it)"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
            yield browser.new_page(viewport={"width": 1600, "height": 1000})
        finally:
            browser.close()


def log_in(page, url: str, airflow_home: Path) -> None:
    """Airflow's own login form, as the admin whose password the simple auth manager made."""
    page.goto(f"{url}/auth/login/")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", admin_password(airflow_home))
    page.click("button[type=submit]")
    page.wait_for_url(lambda u: "/auth/login" not in u, timeout=60_000)
