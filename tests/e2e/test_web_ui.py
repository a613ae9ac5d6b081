"""The playground at / (issue 18) in a real headless browser: Debian's chromium driven by
selenium through chromium-driver (scripts/setup.sh installs both where apt can). Every test
runs with one and with two HTTP workers; screenshots go to tests/artifacts/ (git-ignored)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import RunningServer, internal_states, wait_until_drained

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="no chromium / chromedriver on this machine (scripts/setup.sh installs Debian's where apt-get runs as root)",
)

# An answer that cannot end early: the schema asks for 400 numbers.
LONG_ANSWER_SCHEMA = {"type": "array", "minItems": 400, "items": {"type": "integer"}}


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,800"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def open_page(browser, base_url: str, conversation: list | None = None) -> None:
    browser.get("about:blank")
    browser.get_log("browser")  # what an earlier test's page logged is not this test's
    browser.get(base_url + "/")
    browser.execute_script("localStorage.clear(); sessionStorage.clear();")
    if conversation is not None:
        browser.execute_script("localStorage.setItem('sluice.conversation', arguments[0]);", json.dumps(conversation))
    browser.refresh()
    wait_for(browser, lambda: browser.find_element("id", "model-name").text, "the model name shown")


def wait_for(browser, condition, what: str, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.1)


def fill(browser, element_id: str, value: str) -> None:
    element = browser.find_element("id", element_id)
    element.clear()
    element.send_keys(value)
    browser.execute_script("arguments[0].dispatchEvent(new Event('change'))", element)


def send(browser, text: str) -> None:
    browser.find_element("id", "prompt").send_keys(text)
    browser.find_element("id", "send").click()


def is_idle(browser) -> bool:
    return browser.execute_script("return document.body.dataset.busy") == "no"


def stored_conversation(browser) -> list:
    return browser.execute_script("return JSON.parse(localStorage.getItem('sluice.conversation') || '[]')")


def console_errors(browser) -> list:
    return [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


def screenshot(browser, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def test_a_message_streams_the_apis_greedy_answer(browser, server):
    base_url = server.base_url
    open_page(browser, base_url)
    fill(browser, "temperature", "0")
    fill(browser, "max-tokens", "24")
    send(browser, "Name three rivers in Europe.")
    wait_for(browser, lambda: len(stored_conversation(browser)) == 2 and is_idle(browser), "the reply finished")
    reply = stored_conversation(browser)[-1]
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    api = httpx.post(
        base_url + "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "Name three rivers in Europe."}],
            "temperature": 0,
            "top_p": 1,
            "max_tokens": 24,
        },
        timeout=60,
    ).json()
    assert reply["role"] == "assistant" and reply["content"] == api["choices"][0]["message"]["content"]
    shown = browser.find_elements("css selector", ".message.assistant .content")[-1].text
    assert shown and all(word in reply["content"] for word in shown.split())  # rendered: no markup added
    screenshot(browser, f"web_ui_chat_workers{server.tokenizer_worker_num}")
    assert console_errors(browser) == []


def test_stop_aborts_the_request_and_the_panel_showed_it_running(browser, server):
    base_url = server.base_url
    open_page(browser, base_url)
    fill(browser, "temperature", "0")
    fill(browser, "max-tokens", "3000")
    fill(browser, "schema", json.dumps(LONG_ANSWER_SCHEMA))
    send(browser, "List numbers.")
    # The panel is redrawn at every poll: read it by script, not through a kept element.
    running = "return document.getElementById('live-running')?.textContent"
    wait_for(browser, lambda: browser.execute_script(running) == "1", "the panel shows it running")
    screenshot(browser, f"web_ui_running_workers{server.tokenizer_worker_num}")
    browser.find_element("id", "stop").click()
    wait_for(browser, lambda: is_idle(browser), "the page stopped")
    states = wait_until_drained(base_url)
    assert states["rid_to_state_size"] == 0 and states["kv_tokens_in_use"] == 0
    reply = stored_conversation(browser)[-1]
    assert reply["stopped"] and reply["content"].startswith("[")
    assert console_errors(browser) == []


def test_a_streamed_reply_with_markup_is_shown_as_text(browser, server):
    # A schema whose only answer is a JSON string holding an <img onerror> tag: the model
    # itself writes the markup, through the real stream.
    open_page(browser, server.base_url)
    fill(browser, "temperature", "0")
    fill(browser, "max-tokens", "64")
    fill(browser, "schema", json.dumps({"type": "string", "const": "<img src=x onerror=alert(1)>"}))
    send(browser, "Say something.")
    wait_for(browser, lambda: len(stored_conversation(browser)) == 2 and is_idle(browser), "the reply finished")
    assert stored_conversation(browser)[-1]["content"] == '"<img src=x onerror=alert(1)>"'
    content = browser.find_elements("css selector", ".message.assistant .content")[-1]
    assert content.text == '"<img src=x onerror=alert(1)>"'
    assert browser.execute_script("return document.querySelectorAll('img').length") == 0
    assert console_errors(browser) == []


def test_markup_in_a_stored_reply_is_shown_as_text(browser, server):
    attack = "Look: <img src=x onerror=alert(1)> and <script>alert(2)</script>\n```html\n<b>bold?</b>\n```"
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": attack}]
    open_page(browser, server.base_url, conversation)
    content = browser.find_elements("css selector", ".message.assistant .content")[-1]
    assert content.find_elements("css selector", "img, script, b") == []
    assert "<img src=x onerror=alert(1)>" in content.text and "<b>bold?</b>" in content.text
    assert browser.execute_script("return document.querySelectorAll('img').length") == 0


def test_the_page_asks_for_the_key_and_keeps_it_for_the_session(browser):
    server = RunningServer("--api-key", "secret-key", "--skip-warmup")
    try:
        assert httpx.get(server.base_url + "/", timeout=30).status_code == 200  # the page needs no key
        assert httpx.get(server.base_url + "/get_model_info", timeout=30).status_code == 401
        browser.get("about:blank")
        browser.get(server.base_url + "/")
        browser.execute_script("localStorage.clear(); sessionStorage.clear();")
        browser.refresh()
        wait_for(browser, lambda: browser.find_element("id", "key-dialog").is_displayed(), "the key dialog")
        browser.find_element("id", "key-input").send_keys("secret-key")
        browser.find_element("css selector", "#key-form button").click()
        wait_for(browser, lambda: browser.find_element("id", "model-name").text, "the model name shown")
        assert browser.execute_script("return sessionStorage.getItem('sluice.apiKey')") == "secret-key"
        assert internal_states(server.base_url, {"Authorization": "Bearer secret-key"})["num_running_reqs"] == 0
    finally:
        browser.get("about:blank")  # no page polls the server once it is gone
        server.stop()


def test_disable_web_ui_serves_no_page():
    server = RunningServer("--disable-web-ui", "--skip-warmup")
    try:
        assert httpx.get(server.base_url + "/", timeout=30).status_code == 404
        assert httpx.get(server.base_url + "/web/app.js", timeout=30).status_code == 404
    finally:
        server.stop()
