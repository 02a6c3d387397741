"""`lcap ui` in a real browser: Debian's headless Chromium driven by Playwright, against `lcap ui` child
processes over real stores (one filled as the stages fill it, one captured by `lcap proxy` from real SDK
agents). Every page must load without a console error; what an agent said must show as text, never run."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from fixtures_capture import agent, run_lcap, wait_until  # polled from Python: the CSP forbids Playwright's eval
from fixtures_ui import XSS, UiServer, fill_store

from lcap.store import Store


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui-browser")
    fill_store(Store(root / "ui.duckdb"), root / "tokenizer")
    server = UiServer(root / "ui.duckdb")
    yield server
    server.stop()


@pytest.fixture
def page(browser):
    """A fresh page that records console errors, uncaught exceptions and dialogs (an alert() would be XSS)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = context.new_page()
    tab.problems = []
    tab.on(
        "console",
        lambda m: tab.problems.append(f"console.{m.type}: {m.text}") if m.type in ("error", "warning") else None,
    )
    tab.on("pageerror", lambda e: tab.problems.append(f"pageerror: {e}"))
    tab.on("dialog", lambda d: (tab.problems.append(f"dialog: {d.message}"), d.dismiss()))
    yield tab
    context.close()


def visit(page, url: str) -> None:
    page.goto(url)
    page.wait_for_load_state("load")
    page.wait_for_selector("#live.on", timeout=10_000)  # the live stream is connected


def test_every_page_loads_without_console_errors(ui, page):
    for path in (
        "/",
        "/episodes",
        "/episodes?flag=tampered",
        "/episode?id=ep-calc-0",
        "/episode?id=ep-anthropic",
        "/episode?id=ep-responses",
        "/episode?id=ep-completions",
        "/episode?id=ep-running",
        "/group?round=1&split=train&task=calc-1",
    ):
        visit(page, ui.url + path)
        assert page.problems == [], path
    visit(page, ui.url + "/")
    drawn = page.evaluate("[...document.querySelectorAll('canvas[data-chart]')].map(c => !!Chart.getChart(c))")
    assert drawn == [True] * 6  # every chart drawn by the vendored Chart.js, offline (mismatch seconds: its own)


def test_filters_sorting_and_pagination_in_the_browser(browser, tmp_path):
    from synthetic_store import make_store

    make_store(tmp_path / "many.duckdb", turns=1200)  # 300 episodes
    server = UiServer(tmp_path / "many.duckdb")
    context = browser.new_context()
    page = context.new_page()
    try:
        visit(page, server.url + "/episodes")
        page.select_option("select[name=per_page]", "25")
        page.fill("input[name=task]", "t3")
        page.click("button[type=submit]")
        page.wait_for_url(re.compile(r"task=t3"))
        assert page.inner_text("#count").startswith("8 episodes match")
        page.click("th >> text=sample")  # sort by sample, ascending
        page.wait_for_url(re.compile(r"sort=sample"))
        samples = page.eval_on_selector_all("#rows tr td:nth-child(5)", "cells => cells.map(c => c.textContent)")
        assert samples == [str(n) for n in range(8)]
        page.click("th >> text=sample")  # again: descending
        page.wait_for_url(re.compile(r"order=desc"))
        assert page.inner_text("#rows tr td:nth-child(5) >> nth=0") == "7"
        page.click("text=Reset")
        page.select_option("select[name=per_page]", "100")
        page.click("button[type=submit]")
        first = page.inner_text("#rows tr td >> nth=0")
        page.click("a[rel=next]")
        page.wait_for_url(re.compile(r"page=2"))
        assert page.inner_text("#count") == "300 episodes match · page 2 of 3"
        assert page.inner_text("#rows tr td >> nth=0") != first
        page.keyboard.press("n")  # keyboard: next page
        page.wait_for_url(re.compile(r"page=3"))
        page.keyboard.press("j")
        page.keyboard.press("j")
        target = page.inner_text("#rows tr.selected td >> nth=0")
        page.keyboard.press("Enter")
        page.wait_for_url(re.compile(r"/episode\?id="))
        assert page.inner_text("h1").startswith(f"Episode {target}")
    finally:
        context.close()
        server.stop()


def test_conversation_token_view_and_raw_bodies_show_the_captured_text(ui, page):
    visit(page, ui.url + "/episode?id=ep-calc-3")
    conversation = page.inner_text("#conversation ~ section.turn >> nth=1")
    assert "84" in conversation and "It is about 80." in conversation
    tokens = page.inner_text("[data-tokens]")
    assert "It is about 80." in tokens.replace("\n", "")  # decoded with the deployment's tokenizer
    assert page.locator("[data-tokens] .tok.env").count() > 0 and page.locator("[data-tokens] .boundary").count() == 2
    page.click("#turn-2 button[data-raw*=request]")
    raw = page.locator("#turn-2 .raw-body")
    raw.wait_for(state="visible")
    wait_until(lambda: not raw.inner_text().startswith("loading"))
    assert json.loads(raw.inner_text())["messages"][1]["content"] == "What is 12 * 7?"
    assert page.problems == []


def test_untrusted_text_never_runs(ui, page):
    for path in ("/episode?id=ep-xss", "/episodes", "/group?round=1&split=train&task=" + XSS.replace("#", "%23")):
        visit(page, ui.url + path)
        assert page.evaluate("window.__xss") is None, path
        assert page.locator("img[src=x], main script").count() == 0, path  # no element made from the payload
        assert page.problems == [], path
    visit(page, ui.url + "/episode?id=ep-xss")
    assert XSS in page.inner_text("main")  # shown as text, literally


def test_agent_output_captured_by_the_proxy_is_shown_as_text(capture_env, llm, page, tmp_path):
    """Real SDK agents through `lcap proxy`: the model's answer and a tool call's name and arguments carry
    markup; the UI shows them as the agent received them, and none of it runs."""
    llm.text = "Sure: " + XSS
    task = '<img src=x onerror="window.__xss = 3">'
    done = run_lcap(
        [
            "proxy",
            "--upstream",
            llm.url,
            "--episode",
            "ep-sdk",
            "--label",
            f"task={task}",
            "--label",
            "round=1",
            "--",
            *agent("openai_agent.py"),
            "chat",
            "responses",
        ],
        capture_env,
    )
    assert done.returncode == 0, done.stderr
    llm.tool_call = {"name": "get_weather", "arguments": {"city": XSS}}
    done = run_lcap(
        ["proxy", "--upstream", llm.url, "--episode", "ep-sdk-tools", "--", *agent("openai_agent.py"), "tools"],
        capture_env,
    )
    assert done.returncode == 0, done.stderr
    server = UiServer(Path(capture_env["LCAP_DB"]))
    try:
        visit(page, server.url + "/episode?id=ep-sdk")
        text = page.inner_text("main")
        assert "Say hello. My key is" in text and f"Sure: {XSS}" in text and task in text
        assert "chat" in text and "responses" in text
        visit(page, server.url + "/episode?id=ep-sdk-tools")
        assert "get_weather" in page.inner_text(".tool-call") and XSS.replace('"', '\\"') in page.inner_text(
            ".tool-call"
        )
        visit(page, server.url + "/episodes")
        assert page.evaluate("window.__xss") is None and page.locator("img[src=x]").count() == 0
        assert page.problems == []
    finally:
        server.stop()


def test_live_updates_arrive_without_a_reload(page, tmp_path):
    db = tmp_path / "live.duckdb"
    fill_store(Store(db), tmp_path / "tokenizer", xss=False)
    server = UiServer(db)
    try:
        visit(page, server.url + "/episodes")
        page.evaluate("window.__same_page = true")
        store = Store(db)
        store.start_episode("ep-arrives", command="agent", cwd="/", labels={"task": "new-task", "round": "3"})
        page.wait_for_selector("#rows >> text=ep-arrives", timeout=15_000)
        visit(page, server.url + "/episode?id=ep-running")
        page.evaluate("window.__same_page = true")
        store.append(
            "turns",
            [
                {
                    "turn_id": "ep-running/t9",
                    "episode_id": "ep-running",
                    "seq": 1,
                    "dialect": "chat",
                    "completion_text": "a second call, live",
                    "request": json.dumps({"messages": []}),
                }
            ],
        )
        page.wait_for_selector("text=a second call, live", timeout=15_000)
        assert page.evaluate("window.__same_page") is True  # swapped in place, not reloaded
        visit(page, server.url + "/")
        before = page.inner_text(".stats")
        store.end_episode("ep-arrives", status="ok")
        store.append("rewards", [{"episode_id": "ep-arrives", "value": 1.0, "source": "cli"}])
        wait_until(lambda: page.inner_text(".stats") != before, timeout=15)
        assert page.problems == []
    finally:
        server.stop()


def test_a_planned_end_of_the_live_stream_reconnects_without_saying_so(page, tmp_path):
    """`lcap ui --stream-seconds 1`: the live stream ends every second as planned and the page opens a new one
    without ever showing `live: reconnecting`, which it keeps for a server that went away; updates still arrive."""
    db = tmp_path / "live.duckdb"
    fill_store(Store(db), tmp_path / "tokenizer", xss=False)
    server = UiServer(db, "--stream-seconds", "1")
    try:
        visit(page, server.url + "/episodes")
        shown = set()
        deadline = time.monotonic() + 3.5  # two planned ends, each followed by the browser's retry (1 s)
        while time.monotonic() < deadline:
            shown.add(page.inner_text("#live"))
            time.sleep(0.05)
        assert not [text for text in shown if "reconnecting" in text], shown
        Store(db).start_episode("ep-after-ends", command="agent", cwd="/", labels={"task": "t", "round": "3"})
        page.wait_for_selector("#rows >> text=ep-after-ends", timeout=15_000)
        assert page.problems == []
    finally:
        server.stop()
    wait_until(lambda: "reconnecting" in page.inner_text("#live"), timeout=10)  # the server gone: now it says so


def test_screens_fit_a_phone(ui, page):
    page.set_viewport_size({"width": 390, "height": 844})
    for path in ("/", "/episodes", "/episode?id=ep-calc-0"):
        visit(page, ui.url + path)
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, (path, overflow)  # wide tables scroll inside their own box
    started = time.monotonic()
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Skip to content"
    assert time.monotonic() - started < 5
