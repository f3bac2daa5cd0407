"""One real-browser test: Debian's Chromium driven by Playwright against the launched app."""

import json
import os
import re
import shutil
import time
from pathlib import Path

import pandas as pd
import pytest

playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.slow

DOCS_IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
UPDATE = os.environ.get("MIGRATION_UPDATE_SCREENSHOTS") == "1"  # rewrite the docs' screenshots and their manifest
SCRIPT = """import jax
from flax import jax_utils

state = jax_utils.replicate(state)
p_step = jax.pmap(train_step, axis_name="batch")
for batch in loader:
    state, loss = p_step(state, batch)
    print(float(loss))
"""
FLAGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def app(app_server):
    """The app with no extra flags, shared with tests/test_app.py (see conftest): this test reads only
    its own page's session and the two runs it makes, the newest in the history."""
    return app_server


def shoot(page, tmp_path, name: str, at: str | None = None) -> None:
    """A screenshot for the docs (docs/img/NAME when updating them, else beside the test's other files),
    scrolled to the element `at` (a selector) when given."""
    size = page.viewport_size
    page.set_viewport_size({"width": 1280, "height": 1000})  # a screen's worth, where the element was scrolled to
    if at:
        page.locator(at).evaluate("e => e.scrollIntoView({block: 'start'})")
    page.screenshot(path=str((DOCS_IMG if UPDATE else tmp_path) / name), full_page=False)
    page.set_viewport_size(size)


def test_plan_run_checklist_compare_and_export_in_chromium(app, tmp_path):
    if not Path(CHROMIUM).exists():
        message = "Debian's Chromium is missing: `apt-get install -y chromium` (.ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI must run the browser test
        pytest.skip(message)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, chromium_sandbox=False)
        page = browser.new_page(accept_downloads=True, viewport={"width": 1280, "height": 2400})
        page.goto(f"{app.url}?token={app.token}")  # the URL the server prints
        page.get_by_label("Global batch").wait_for(timeout=60_000)
        tabs = [t.strip() for t in page.get_by_role("tab").all_inner_texts()]
        if not UPDATE:  # the docs' screenshots show this page's tabs, or are retaken
            manifest = json.loads((DOCS_IMG / "screenshots.json").read_text(encoding="utf-8"))
            assert tabs == manifest["tabs"], "the docs' screenshots are stale: MIGRATION_UPDATE_SCREENSHOTS=1"
        # Nothing has run: no empty tables or plots fill the page.
        for label in ("Results", "Choices that fit", "Side by side", "Decisions with their reasons"):
            assert not page.get_by_text(label, exact=False).first.is_visible()
        page.get_by_label("Global batch").fill("32")
        page.get_by_label("Steps").fill("6")
        page.get_by_role("button", name="Plan", exact=True).click()
        page.get_by_text("Plan:", exact=False).first.wait_for(timeout=180_000)
        assert "compiled-for-target" in page.content()
        assert page.get_by_text("Choices that fit", exact=False).first.is_visible()
        # The before/after panel comes first, above the tables, with its two charts drawn.
        panel = page.locator("#before-after-plan")
        panel.get_by_text("time to train 1T tokens").wait_for(timeout=30_000)
        for chart in ("#time-plot", "#cost-plot"):
            page.locator(f"{chart} canvas, {chart} svg").first.wait_for(timeout=30_000)
        tops = page.evaluate("() => ['#before-after-plan', '#time-plot', '.decisions'].map("
                             "s => document.querySelector(s).getBoundingClientRect().top)")
        assert tops[0] < tops[1] < tops[2], tops
        # The decisions wrap their reasons: nothing cut off or scrolled sideways.
        widths = page.evaluate("() => [document.querySelector('.decisions').scrollWidth, "
                               "document.querySelector('.decisions').clientWidth]")
        assert widths[0] <= widths[1] + 1, f"the decisions scroll sideways: {widths}"
        assert page.locator(".dec-item").count() >= 6
        page.evaluate("() => document.querySelector('#before-after-plan').scrollIntoView({block: 'start'})")
        shoot(page, tmp_path, "plan.png")

        run = page.get_by_role("button", name="Run on this machine")
        run.click()
        page.get_by_text("Run finished").first.wait_for(timeout=300_000)
        page.get_by_text("samples/s", exact=True).wait_for(timeout=30_000)
        # The checklist reads as a report: a badge, the evidence and the action of every item, on the page's width.
        items = page.locator(".ck-item")
        items.first.wait_for(timeout=30_000)  # the results table and the checklist render one after the other
        assert items.count() >= 12
        assert page.locator(".ck-item .ck-badge").count() == items.count()
        assert items.first.inner_text().count("Evidence:") == 1 and "Action:" in items.first.inner_text()
        widths = page.evaluate("() => [document.querySelector('.checklist').scrollWidth, "
                               "document.querySelector('.checklist').clientWidth]")
        assert widths[0] <= widths[1] + 1, f"the checklist scrolls sideways: {widths}"
        with page.expect_download(timeout=60_000) as download:
            page.locator("a[href*='report-transformer-tiny']").first.click()
        saved = tmp_path / "report.csv"
        download.value.save_as(saved)
        page.screenshot(path=str(tmp_path / "results.png"), full_page=True)
        page.get_by_text("Run finished").first.scroll_into_view_if_needed()
        shoot(page, tmp_path, "migrate.png")

        # A second run of the same plan, then compare the two in the History tab.
        run.click()  # the first run's headline goes, then the second's comes
        page.wait_for_function("() => !document.body.innerText.includes('Run finished')", timeout=60_000)
        page.get_by_text("Run finished").first.wait_for(timeout=300_000)
        page.get_by_role("tab", name="History").click()
        page.get_by_role("button", name="Refresh").click()
        rows = page.locator("#history-table").get_by_role("row").filter(has=page.get_by_role("gridcell"))
        rows.first.wait_for(timeout=30_000)
        run_rows = [i for i in range(rows.count())
                    if "run" in [t.strip() for t in rows.nth(i).get_by_role("gridcell").all_inner_texts()]]
        assert len(run_rows) >= 2
        for i in run_rows[:2]:
            rows.nth(i).get_by_role("gridcell").nth(1).click()  # selects the row
        selected = page.get_by_label("Selected ids", exact=False)
        deadline = time.monotonic() + 30
        while not re.fullmatch(r"\d+,\d+", selected.input_value()) and time.monotonic() < deadline:
            time.sleep(0.2)
        ids = selected.input_value()
        page.get_by_role("button", name="Compare selected").click()
        compared = page.locator("#compare-table").get_by_role("row").filter(has=page.get_by_role("gridcell"))
        compared.first.wait_for(timeout=60_000)
        assert compared.count() == 2
        for chart in ("#compare-throughput", "#compare-memory", "#compare-loss"):  # drawn, not placeholders
            page.locator(f"{chart} canvas, {chart} svg").first.wait_for(timeout=30_000)
        with page.expect_download(timeout=60_000) as download:
            page.get_by_role("button", name="Export selected (CSV)").click()
            page.locator("a[href*='selection-']").first.click(timeout=60_000)
        exported = tmp_path / "selection.csv"
        download.value.save_as(exported)
        page.screenshot(path=str(tmp_path / "history.png"), full_page=True)
        page.locator("#compare-table").scroll_into_view_if_needed()
        shoot(page, tmp_path, "history.png")

        # The code check in the browser: a pasted pmap-era loop gives its findings.
        page.get_by_role("tab", name="Code check").click()
        page.locator(".cm-content").first.click()
        page.keyboard.insert_text(SCRIPT)
        page.get_by_role("button", name="Check", exact=True).click()
        page.get_by_text("PMAP001", exact=False).first.wait_for(timeout=120_000)
        assert page.get_by_text("SYNC001", exact=False).first.is_visible()
        shoot(page, tmp_path, "codecheck.png")
        # The Serve tab's checklist grades host sync from that check, in the same page.
        page.get_by_role("tab", name="Serve").click()
        page.get_by_role("button", name="Plan serving").click()
        checklist = page.locator("#serve-checklist")
        checklist.get_by_text("SYNC001", exact=False).first.wait_for(timeout=300_000)
        assert checklist.locator('[data-id="serve_host_sync"][data-status="fail"]').count() == 1
        shoot(page, tmp_path, "serve.png", at="#serve-table")
        browser.close()
    if UPDATE:
        images = ["plan.png", "migrate.png", "history.png", "codecheck.png", "serve.png"]
        (DOCS_IMG / "screenshots.json").write_text(json.dumps({"tabs": tabs, "images": images}, indent=1) + "\n",
                                                  encoding="utf-8")
    frame = pd.read_csv(saved)
    assert frame.loc[0, "status"] == "ok" and frame.loc[0, "global_batch"] == 32
    selection = pd.read_csv(exported)
    assert sorted(selection["id"]) == sorted(int(i) for i in ids.split(","))
    assert set(selection["kind"]) == {"run"} and (selection["status"] == "ok").all()
    assert (tmp_path / "results.png").stat().st_size > 10_000
