"""The chat page at ``/``, driven in a real headless Chromium with selenium.

The server's replies are scripted (see ``formats.py``) so the page meets
reasoning, tool calls and a long generation it can stop. A failing test
keeps a screenshot of the page under ``.work/screenshots/``.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import mlx_loom
from mlx_loom.serve import make_server

from .conftest import Client
from .formats import FORMATS, SCRIPTED_CALLS, WEATHER_TOOL, scripted, write_format_checkpoint

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="the chat-page tests need Chromium and its driver: apt-get install chromium "
    "chromium-driver (CI installs them)",
)
SCREENSHOTS = Path(__file__).resolve().parents[2] / ".work" / "screenshots"
WAIT = 20.0


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[object, object]]:
    path = write_format_checkpoint(tmp_path_factory.mktemp("page") / "ckpt", FORMATS["json_tools"])
    model, tokenizer = mlx_loom.load(path)
    server = make_server(model, tokenizer, port=0, model_id="page-model")
    worker = scripted(server)
    server.start_in_background()
    try:
        yield server, worker
    finally:
        server.stop()


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-dev-shm-usage",
        "--window-size=1200,900",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, read below
    browser = webdriver.Chrome(service=Service(DRIVER), options=options)
    browser.set_script_timeout(WAIT)
    try:
        yield browser
    finally:
        browser.quit()


@pytest.fixture
def page(driver, served, request):
    """The chat page, freshly loaded; a screenshot is kept if the test fails."""
    server, worker = served
    worker.delay, worker.chunk = 0.0, 3
    driver.get(server.url + "/")
    wait_for(lambda: driver.find_element("id", "model").get_attribute("value"))
    yield driver
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        shot = SCREENSHOTS / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', request.node.name)}.png"
        driver.save_screenshot(str(shot))
        print(f"screenshot of the failing page: {shot}")


def wait_for(condition, timeout: float = WAIT):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except Exception:  # noqa: BLE001 - the element may not exist yet
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("the page did not reach the expected state in time")
        time.sleep(0.05)


def say(page, text: str) -> None:
    box = page.find_element("id", "input")
    box.send_keys(text)
    page.find_element("id", "send").click()


def last_reply(page):
    return page.find_elements("css selector", ".msg.assistant")[-1]


def text_of(element) -> str:
    """Text including what a closed <details> hides."""
    return element.get_attribute("textContent")


def test_the_page_is_self_contained(served):
    html = Client(served[0]).get("/")
    assert html.status == 200 and html.headers["Content-Type"].startswith("text/html")
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html.text)


def test_loading_the_page_logs_no_failed_request(page):
    # Without an icon of its own the browser asks for /favicon.ico: a 404 in the console.
    page.get(page.current_url)
    wait_for(lambda: page.find_element("id", "model").get_attribute("value"))
    time.sleep(0.5)  # the icon is fetched after the page settles
    failures = [e["message"] for e in page.get_log("browser") if e["level"] == "SEVERE"]
    assert failures == []


def test_the_page_offers_the_served_model(page):
    options = page.find_elements("css selector", "#model option")
    assert [o.text for o in options] == ["page-model"]


def test_a_reply_streams_in_with_reasoning_and_tool_calls_folded(page, served):
    _, worker = served
    worker.script(
        "<think>The user wants weather.</think>Let me look." + SCRIPTED_CALLS["json_tools"]
    )
    page.find_element("id", "toggle-settings").click()
    page.find_element("id", "tools").send_keys(json.dumps([WEATHER_TOOL]))
    say(page, "weather in Paris?")
    reply = wait_for(
        lambda: last_reply(page).find_element("css selector", ".stats") and last_reply(page)
    )
    reasoning = reply.find_element("css selector", "details.reasoning")
    assert reasoning.get_attribute("open") is None  # folded
    assert text_of(reasoning.find_element("tag name", "pre")) == "The user wants weather."
    call = reply.find_element("css selector", "details.tool-call")
    assert call.get_attribute("open") is None
    assert call.find_element("tag name", "summary").text == "tool call: get_weather"
    assert json.loads(text_of(call.find_element("tag name", "pre"))) == {"city": "Paris", "days": 2}
    assert reply.find_element("css selector", ".content").text == "Let me look."
    stats = reply.find_element("css selector", ".stats").text
    assert re.search(r"\d+ tokens · [\d.]+ tok/s · tool_calls", stats), stats
    # The request the page sent carried the tools; the next message answers the call.
    assert "get_weather" in page.execute_script("return JSON.stringify(conversation)")
    assert page.find_element("id", "role").get_attribute("value") == "tool"


def test_the_conversation_continues_with_the_history(page, served):
    _, worker = served
    worker.script("First answer.", "Second answer.")
    say(page, "one")
    wait_for(lambda: last_reply(page).find_elements("css selector", ".stats"))
    say(page, "two")
    wait_for(lambda: len(page.find_elements("css selector", ".stats")) == 2)
    assert last_reply(page).find_element("css selector", ".content").text == "Second answer."
    tokenizer = served[0].app.tokenizer
    history = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": "two"},
    ]
    assert worker.jobs[-1].prompt == tokenizer.encode_chat(history)


def test_stop_ends_a_running_generation(page, served):
    _, worker = served
    worker.delay, worker.chunk = 0.05, 1
    long_text = "word " * 400  # 2000 pieces: 100 s unless stopped
    worker.script(long_text)
    say(page, "talk a lot")
    wait_for(lambda: len(last_reply(page).find_element("css selector", ".content").text) > 10)
    assert page.find_element("id", "send").is_displayed() is False
    page.find_element("id", "stop").click()
    stats = wait_for(lambda: last_reply(page).find_element("css selector", ".stats"))
    assert stats.text.endswith("stopped")
    assert page.find_element("id", "send").is_displayed()
    job = worker.jobs[-1]
    wait_for(lambda: job.cancelled, timeout=5)
    shown = last_reply(page).find_element("css selector", ".content").text
    assert 0 < len(shown) < len(long_text.strip())


def test_a_long_replys_stats_line_is_scrolled_into_view(page, served):
    # The stats line is added after the last chunk: the view must follow it, or
    # it sits under the input box.
    _, worker = served
    worker.chunk = 20
    worker.script("a long line of the reply\n" * 120)
    say(page, "tell me everything")
    stats = wait_for(lambda: last_reply(page).find_element("css selector", ".stats"))
    time.sleep(0.2)
    gap = page.execute_script(
        "const s = arguments[0].getBoundingClientRect();"
        "const m = document.getElementById('messages').getBoundingClientRect();"
        "return m.bottom - s.bottom;",
        stats,
    )
    assert gap >= 0, f"the stats line ends {-gap:.0f} px below the visible messages"


def test_an_error_answer_is_shown(page, served):
    page.find_element("id", "max-tokens").clear()
    page.find_element("id", "max-tokens").send_keys("999999")
    say(page, "hello")
    error = wait_for(lambda: page.find_element("css selector", ".msg.error"))
    assert "max_tokens" in error.text


def test_a_server_with_an_api_key_asks_for_it_and_then_serves(driver, tmp_path):
    path = write_format_checkpoint(tmp_path / "ckpt", FORMATS["json_tools"])
    model, tokenizer = mlx_loom.load(path)
    server = make_server(model, tokenizer, port=0, model_id="keyed", api_key="page-key")
    worker = scripted(server)
    server.start_in_background()
    try:
        driver.get(server.url + "/")
        driver.execute_script("localStorage.clear()")
        driver.get(server.url + "/")
        wait_for(lambda: "API key" in driver.find_element("id", "status").text)
        key = driver.find_element("id", "api-key")
        assert key.is_displayed()
        key.send_keys("page-key")
        driver.find_element("id", "input").click()  # leaving the field saves the key
        wait_for(lambda: driver.find_element("id", "model").get_attribute("value") == "keyed")
        worker.script("Authenticated answer.")
        say(driver, "hi")
        reply = wait_for(lambda: last_reply(driver).find_elements("css selector", ".stats"))
        assert reply
        assert last_reply(driver).find_element("css selector", ".content").text == (
            "Authenticated answer."
        )
    finally:
        driver.execute_script("localStorage.clear()")
        server.stop()
