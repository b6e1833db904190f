"""The web console in a real browser: headless Chromium (the distribution's package, driven
by Selenium) against a real `engine serve`. It asks for the API key, lists the model, streams
a reply token by token, stops it (the server ends the request), and its dashboard shows the
running count rise and fall; a greedy reply equals the API's. Screenshots are kept under
``$TEST_ARTIFACTS/web-console`` (default ``test-artifacts/``) for a person to look at."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.plugin_packages import environ_with, write_distribution
from tests.serving import API_KEY, serve

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="needs Debian's chromium and chromium-driver (`make browser` installs them where apt-get runs "
    "as root)",
)

PACE = '''\
"""test-pace: every step takes 20 ms more, so a tiny model's reply is still streaming when the
browser acts on it."""

import time

from engine import hookimpl
from engine.interfaces import LogitsProcessor


@hookimpl
def register_logits_processors(register):
    register("test-pace", Pace, api=1)


class Pace(LogitsProcessor):
    def apply(self, logits, requests):
        time.sleep(0.02)
        return logits
'''


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    site = tmp_path_factory.mktemp("pace-plugin") / "site"
    write_distribution(site, "tessellm-logits-test-pace", "test-pace", "engine_logits_test_pace", PACE)
    args = ("--served-model-name", "tiny-llama", "--dtype", "float32", "--max-model-len", "512")
    with serve(tiny_llama[0], *args, "--logits-processors", "test-pace", env=environ_with(site)) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def artifacts() -> Path:
    folder = Path(os.environ.get("TEST_ARTIFACTS", "test-artifacts")) / "web-console"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def wait(predicate, what: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


def text(browser, element_id: str) -> str:
    return browser.find_element("id", element_id).text


def replies(browser):
    return browser.find_elements("css selector", ".message.assistant")


def set_field(browser, element_id: str, value: str) -> None:
    field = browser.find_element("id", element_id)
    field.clear()
    field.send_keys(value)


def test_chat_streams_stops_and_the_dashboard_follows(server, browser, artifacts):
    from selenium.webdriver.common.keys import Keys

    browser.get(f"{server.url}/?poll=200")  # the root leads to /ui/
    assert browser.current_url.endswith("/ui/?poll=200")
    wait(lambda: "API key" in text(browser, "connection"), "the page to ask for the key")
    browser.find_element("id", "api-key").send_keys(API_KEY + Keys.TAB)
    wait(lambda: browser.find_element("id", "model").get_attribute("value") == "tiny-llama", "the model list")

    set_field(browser, "max-tokens", "400")
    browser.find_element("id", "prompt").send_keys("Tell me a long story" + Keys.ENTER)
    reply = wait(lambda: replies(browser), "the reply")[-1]
    seen = wait(lambda: reply.text.removeprefix("assistant").strip(), "the first tokens")
    wait(lambda: len(reply.text.removeprefix("assistant").strip()) > len(seen), "more tokens")  # streamed
    wait(lambda: text(browser, "stat-running") == "1", "the dashboard to count the request")
    browser.save_screenshot(str(artifacts / "streaming.png"))

    browser.find_element("id", "stop").click()
    wait(lambda: text(browser, "status") == "stopped", "the stop")
    assert "stopped" in reply.get_attribute("class")
    assert server.wait_for_metric("vllm:num_requests_running", lambda v: v == 0) == 0  # ended, not orphaned
    wait(lambda: text(browser, "stat-running") == "0", "the dashboard to see it end")
    wait(lambda: text(browser, "stat-ttft") != "– / – ms", "the TTFT percentiles")
    browser.save_screenshot(str(artifacts / "stopped.png"))
    assert len(reply.text.split()) < 400  # it did not run to max_tokens


def test_greedy_reply_with_a_system_prompt_equals_the_api(server, browser, artifacts):
    from selenium.webdriver.common.keys import Keys

    browser.find_element("id", "clear").click()
    set_field(browser, "system", "You are terse.")
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "12")
    browser.find_element("id", "prompt").send_keys("Hello there" + Keys.ENTER)
    wait(lambda: "tokens in" in text(browser, "status"), "the reply to finish")
    shown = replies(browser)[-1].find_element("css selector", ".text").text
    expected = (
        server.openai()
        .chat.completions.create(
            model="tiny-llama",
            messages=[
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Hello there"},
            ],
            temperature=0,
            top_p=1,
            max_tokens=12,
        )
        .choices[0]
        .message.content
    )
    assert shown == expected.strip()  # the page shows whitespace-trimmed text
    assert len(replies(browser)) == 1  # "New chat" cleared the stopped one
    browser.save_screenshot(str(artifacts / "greedy.png"))
