"""One real-browser test: Debian's Chromium driven by Playwright against the launched app. It walks a code
check, a plan and a run, History's comparison (with a valid and an invalid selection), Stop with nothing
running, and Serve with training code and then serving code checked; it fails on any HTTP 5xx the page
receives, and on any visible table cell a person cannot read: a float of more than four significant digits,
or a bare number without a unit in its cell or a count in its header."""

import json
import os
import re
import shutil
import time
from pathlib import Path

import pandas as pd
import pytest

from tests.test_frames import unreadable

playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DOCS_IMG = ROOT / "docs" / "img"
SHOTS = ROOT / "screenshots"  # git ignores it: each run's pictures, the docs' and README's source
UPDATE = os.environ.get("MIGRATION_UPDATE_SCREENSHOTS") == "1"  # copy them to docs/img with their manifest
SCRIPT = """import jax
from flax import jax_utils

state = jax_utils.replicate(state)
p_step = jax.pmap(train_step, axis_name="batch")
for batch in loader:
    state, loss = p_step(state, batch)
    print(float(loss))
"""
SERVER = """import jax

decode = jax.jit(decode_step)
for request in requests:
    for _ in range(request.max_tokens):
        logits, cache = decode(params, cache, token)
        token = logits.argmax(-1)
        scores.append(float(logits.max()))
"""
FLAGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Every visible table of the page: its id, headers and its cells' text (Gradio's data frames render a cell's
# text in a .cell-wrap; a hidden sizing row holds none).
VISIBLE_TABLES = """() => [...document.querySelectorAll('table')].filter(t => t.offsetParent !== null).map(t => ({
  id: (t.closest('[id]') || {}).id || '',
  head: [...t.querySelectorAll('thead th')].map(h => h.innerText.trim()),
  rows: [...t.querySelectorAll('tbody tr')].map(r => [...r.querySelectorAll('td')].map(c => c.innerText.trim()))
        .filter(r => r.some(c => c !== ''))}))"""


@pytest.fixture
def app(app_server):
    """The app with no extra flags, shared with tests/test_app.py (see conftest): this test reads only
    its own page's session and the two runs it makes, the newest in the history."""
    return app_server


def shoot(page, name: str, at: str | None = None) -> None:
    """A screenshot of a screen's worth, scrolled to the element `at` (a selector) when given, into SHOTS."""
    size = page.viewport_size
    page.set_viewport_size({"width": 1280, "height": 1000})
    if at:
        page.locator(at).evaluate("e => e.scrollIntoView({block: 'start'})")
    SHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SHOTS / name), full_page=False)
    page.set_viewport_size(size)


def check_code(page, text: str, kind: str) -> None:
    page.get_by_role("tab", name="Code check").click()
    page.get_by_label(kind, exact=True).check()
    editor = page.locator(".cm-content").first
    editor.click()
    page.keyboard.press("Control+A")
    page.keyboard.press("Delete")
    page.keyboard.insert_text(text)
    page.get_by_role("button", name="Check", exact=True).click()
    page.get_by_text(f"items about your {kind} code", exact=False).first.wait_for(timeout=120_000)


def test_plan_run_checklist_compare_and_export_in_chromium(app, tmp_path):
    if not Path(CHROMIUM).exists():
        message = "Debian's Chromium is missing: `apt-get install -y chromium` (.ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI must run the browser test
        pytest.skip(message)
    server_errors: list[str] = []
    unreadable_cells: list[str] = []

    def read_tables(page) -> None:
        unreadable_cells.extend(unreadable(page.evaluate(VISIBLE_TABLES)))

    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, chromium_sandbox=False)
        page = browser.new_page(accept_downloads=True, viewport={"width": 1280, "height": 2400})
        page.on("response", lambda r: server_errors.append(f"{r.status} {r.url}") if r.status >= 500 else None)
        page.goto(f"{app.url}?token={app.token}")  # the URL the server prints
        page.get_by_label("Global batch").wait_for(timeout=60_000)
        tabs = [t.strip() for t in page.get_by_role("tab").all_inner_texts()]
        if not UPDATE:  # the docs' screenshots show this page's tabs, or are retaken
            manifest = json.loads((DOCS_IMG / "screenshots.json").read_text(encoding="utf-8"))
            assert tabs == manifest["tabs"], "the docs' screenshots are stale: MIGRATION_UPDATE_SCREENSHOTS=1"
        # Nothing has run: no empty tables or plots fill the page; Stop says there is nothing to stop.
        for label in ("Results", "Choices that fit", "Side by side", "Decisions with their reasons"):
            assert not page.get_by_text(label, exact=False).first.is_visible()
        page.get_by_role("button", name="Stop").first.click()
        page.get_by_text("there is nothing to stop", exact=False).first.wait_for(timeout=30_000)

        # The code check of a pmap-era training script: the Migrate checklist grades from it.
        check_code(page, SCRIPT, "training")
        page.get_by_text("PMAP001", exact=False).first.wait_for(timeout=30_000)
        assert page.get_by_text("SYNC001", exact=False).first.is_visible()
        read_tables(page)
        shoot(page, "codecheck.png", at="#check-button")

        page.get_by_role("tab", name="Migrate").click()
        # A refusal shows beside the buttons (the progress line under them), not only in Gradio's notice
        page.get_by_label("Global batch").fill("-4")
        page.get_by_role("button", name="Plan", exact=True).click()
        page.locator("#progress").get_by_text("Invalid input — global_batch", exact=False).wait_for(timeout=60_000)
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
        read_tables(page)
        page.evaluate("() => document.querySelector('#before-after-plan').scrollIntoView({block: 'start'})")
        shoot(page, "plan.png")

        run = page.get_by_role("button", name="Run on this machine")
        run.click()
        page.get_by_text("Run finished").first.wait_for(timeout=300_000)
        results = page.locator("#results-table")
        results.get_by_text("throughput, measured on", exact=False).first.wait_for(timeout=30_000)
        # A CPU run's peak memory is XLA's compiled figure: labelled so, never "measured"
        assert results.get_by_text("peak memory per device, compiled for cpu", exact=False).count() == 1
        assert results.get_by_text("peak memory per device, measured", exact=False).count() == 0
        # Every row of the report is on the page, none hidden in a scroll box inside it
        assert results.get_by_text("fp32 matmul precision").is_visible()
        # The checklist reads as a report: a badge, the evidence and the action of every item, on the page's width.
        items = page.locator(".ck-item")
        items.first.wait_for(timeout=30_000)  # the results table and the checklist render one after the other
        assert items.count() >= 12
        assert page.locator(".ck-item .ck-badge").count() == items.count()
        assert items.first.inner_text().count("Evidence:") == 1 and "Action:" in items.first.inner_text()
        # The session's code check found pmap: the pmap item fails with the finding's line
        pmap_item = page.locator('.ck-item[data-id="pmap"]')
        assert pmap_item.get_attribute("data-status") == "fail" and "PMAP001" in pmap_item.inner_text()
        assert "ESTIMATE" not in page.locator('.ck-item[data-id="benchmark"]').inner_text()
        widths = page.evaluate("() => [document.querySelector('.checklist').scrollWidth, "
                               "document.querySelector('.checklist').clientWidth]")
        assert widths[0] <= widths[1] + 1, f"the checklist scrolls sideways: {widths}"
        read_tables(page)
        with page.expect_download(timeout=60_000) as download:
            page.locator("a[href*='report-transformer-tiny']").first.click()
        saved = tmp_path / "report.csv"
        download.value.save_as(saved)
        # The file's whole name shows, not cut to "report-transformer-tiny-202… .csv"
        assert "…" not in page.locator(".file-preview").first.inner_text()
        shoot(page, "migrate.png", at="#results-table")  # the README's picture: the report, labelled figures

        # A second run of the same plan; the History fills itself as each job ends (no Refresh).
        run.click()  # the first run's headline goes, then the second's comes
        page.wait_for_function("() => !document.body.innerText.includes('Run finished')", timeout=60_000)
        page.get_by_text("Run finished").first.wait_for(timeout=300_000)
        page.get_by_role("tab", name="History").click()
        rows = page.locator("#history-table").get_by_role("row").filter(has=page.get_by_role("gridcell"))
        deadline = time.monotonic() + 30
        run_rows: list[int] = []
        plan_rows: list[int] = []
        while len(run_rows) < 2 and time.monotonic() < deadline:
            kinds = [[t.strip() for t in rows.nth(i).get_by_role("gridcell").all_inner_texts()]
                     for i in range(rows.count())]
            run_rows = [i for i, cells in enumerate(kinds) if "run" in cells]
            plan_rows = [i for i, cells in enumerate(kinds) if "plan" in cells]
            time.sleep(0.5)
        assert len(run_rows) >= 2 and plan_rows, "the History did not show the plan and both runs by itself"
        selected = page.get_by_label("Selected ids", exact=False)
        message = page.locator("#history-message")
        # Compare with nothing selected, then with a plan and one run: each says why, beside the buttons.
        page.get_by_role("button", name="Compare selected").click()
        message.get_by_text("Select two or more training runs", exact=False).wait_for(timeout=30_000)
        rows.nth(plan_rows[0]).get_by_role("gridcell").nth(1).click()
        rows.nth(run_rows[0]).get_by_role("gridcell").nth(1).click()
        deadline = time.monotonic() + 30
        while not re.fullmatch(r"\d+,\d+", selected.input_value()) and time.monotonic() < deadline:
            time.sleep(0.2)
        page.get_by_role("button", name="Compare selected").click()
        message.get_by_text("not training runs", exact=False).wait_for(timeout=30_000)
        selected.fill("")
        for i in run_rows[:2]:
            rows.nth(i).get_by_role("gridcell").nth(1).click()  # selects the row
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
        # The loss chart's step axis ticks whole steps; the throughput bars start at zero
        ticks = page.evaluate("() => [...document.querySelectorAll('#compare-loss .role-axis[aria-label^=X-axis] .role-axis-label text')]"
                              ".map(t => t.textContent)")
        assert ticks and all(re.fullmatch(r"\d+", t.strip()) for t in ticks), ticks
        bar_ticks = page.evaluate("() => [...document.querySelectorAll('#compare-throughput .role-axis[aria-label^=Y-axis] .role-axis-label text')]"
                                  ".map(t => t.textContent)")
        assert "0" in bar_ticks, bar_ticks
        read_tables(page)
        with page.expect_download(timeout=60_000) as download:
            page.get_by_role("button", name="Export selected (CSV)").click()
            page.locator("a[href*='selection-']").first.click(timeout=60_000)
        exported = tmp_path / "selection.csv"
        download.value.save_as(exported)
        shoot(page, "history.png", at="#compare-table")

        # Serve: the training script checked above grades no serving item ...
        page.get_by_role("tab", name="Serve").click()
        page.get_by_role("button", name="Plan serving").click()
        checklist = page.locator("#serve-checklist")
        checklist.get_by_text("Serving checklist").wait_for(timeout=300_000)
        assert checklist.locator('[data-id="serve_host_sync"][data-status="not checked"]').count() == 1
        assert checklist.locator('[data-id="serve_recompiles"][data-status="pass"]').count() == 0
        read_tables(page)
        # ... a serving script checked as such does: its per-token host read fails the item
        check_code(page, SERVER, "serving")
        page.get_by_role("tab", name="Serve").click()
        page.get_by_role("button", name="Plan serving").click()
        checklist.locator('[data-id="serve_host_sync"][data-status="fail"]').wait_for(timeout=300_000)
        assert "SYNC001" in checklist.locator('[data-id="serve_host_sync"]').inner_text()
        read_tables(page)
        shoot(page, "serve.png", at="#serve-table")
        browser.close()
    assert not server_errors, f"the page received server errors: {server_errors}"
    assert not unreadable_cells, f"cells a person cannot read: {unreadable_cells}"
    if UPDATE:
        images = ["plan.png", "migrate.png", "history.png", "codecheck.png", "serve.png"]
        for name in images:
            shutil.copyfile(SHOTS / name, DOCS_IMG / name)
        (DOCS_IMG / "screenshots.json").write_text(json.dumps({"tabs": tabs, "images": images}, indent=1) + "\n",
                                                  encoding="utf-8")
    frame = pd.read_csv(saved)
    assert frame.loc[0, "status"] == "ok" and frame.loc[0, "global_batch"] == 32
    selection = pd.read_csv(exported)
    assert sorted(selection["id"]) == sorted(int(i) for i in ids.split(","))
    assert set(selection["kind"]) == {"run"} and (selection["status"] == "ok").all()
