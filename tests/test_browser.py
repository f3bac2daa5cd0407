"""One real-browser test: Debian's Chromium driven by Playwright against the launched app."""

import os
import shutil
from pathlib import Path

import pandas as pd
import pytest

from tests.test_app import App

playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.slow

FLAGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def app(tmp_path):
    a = App(tmp_path)
    yield a
    a.close()


def test_plan_run_see_results_and_download_csv_in_chromium(app, tmp_path):
    if not Path(CHROMIUM).exists():
        message = "Debian's Chromium is missing: `apt-get install -y chromium` (.ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI must run the browser test
        pytest.skip(message)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS,
                                    chromium_sandbox=False)
        page = browser.new_page(accept_downloads=True, viewport={"width": 1400, "height": 2400})
        page.goto(app.url)
        page.get_by_label("Global batch").fill("32")
        page.get_by_label("Steps").fill("6")
        page.get_by_role("button", name="Plan", exact=True).click()
        page.get_by_text("Plan:", exact=False).first.wait_for(timeout=180_000)
        assert "compiled-for-target" in page.content()
        page.get_by_role("button", name="Run on this machine").click()
        page.get_by_text("Run finished").wait_for(timeout=300_000)
        page.get_by_text("samples/s", exact=True).wait_for(timeout=30_000)
        page.screenshot(path=str(tmp_path / "results.png"), full_page=True)
        with page.expect_download(timeout=60_000) as download:
            page.locator("a[href*='report-transformer-tiny']").first.click()
        saved = tmp_path / "report.csv"
        download.value.save_as(saved)
        browser.close()
    frame = pd.read_csv(saved)
    assert frame.loc[0, "status"] == "ok" and frame.loc[0, "global_batch"] == 32
    assert (tmp_path / "results.png").stat().st_size > 10_000
