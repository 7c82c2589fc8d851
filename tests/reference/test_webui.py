"""The web UI of `llmfw serve` (``/``), driven in a real headless Chromium against real servers on 127.0.0.1.

The browser is Debian's ``chromium`` package (``.ci/run`` installs it), driven by Playwright for Python through
``executable_path`` (no browser download). Playwright gives every launch a fresh temporary profile; the flags keep
Chromium from reaching the internet. Without Chromium (or Playwright) the module skips with the reason — except
under ``CI=true``, where it fails instead. Every page records the requests it makes: none may leave the server
it came from, and no script error may happen.

The servers are real ``llmfw serve`` processes on the numpy backend with two slots; replies are short.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

from support.live_server import LiveServer, free_port, get

ROOT = Path(__file__).resolve().parents[2]
#: what a test waits at most for a reply, and for anything else (the machine running the suite may be busy;
#: nothing here is timed)
WAIT_MS = 180_000
ACTION_MS = 30_000
API_KEY = "webui-test-key-5f1c"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
PET = {"type": "object", "properties": {
    "kind": {"enum": ["cat", "dog", "fish"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "name": {"type": "string", "pattern": "^[A-Za-z]{1,6}$"}},
    "required": ["kind", "age", "name"], "additionalProperties": False}


def missing(reason: str) -> None:
    """Skip without the browser, except in CI, where the browser tests must run."""
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(f"{reason} (CI is set: the web UI's browser tests must run, not skip)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        missing("Debian's chromium package is not installed (apt-get install chromium; .ci/run installs it)")
    return path


def expect(locator):
    """Playwright's assertions (they wait in the page without eval, which the page's CSP forbids)."""
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(locator)


@pytest.fixture(scope="module")
def browser(chromium):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("Playwright for Python is not installed (pip install -e '.[test]')")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


# -- servers --------------------------------------------------------------------------------------------------------
class ServeProcess:
    """``llmfw serve`` in a subprocess on a free port; its output (both streams) goes to a file the tests read."""

    def __init__(self, model: Path, log: Path, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(log, "w") as output:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmfw.cli", "serve", "-m", str(model), "--backend", "numpy", "-np", "2",
                 "-c", "1024", "--port", str(self.port), "--alias", "smol", *flags],
                stdout=output, stderr=subprocess.STDOUT, env=env)
        self.page_line = self._wait_for("chat in a browser at")

    def _wait_for(self, text: str) -> str:
        deadline = time.monotonic() + WAIT_MS / 1000
        while time.monotonic() < deadline:
            for line in self.log.read_text().splitlines():
                if text in line:
                    return line
            assert self.proc.poll() is None, f"llmfw serve exited early:\n{self.log.read_text()}"
            time.sleep(0.1)
        raise AssertionError(f"llmfw serve never printed {text!r}:\n{self.log.read_text()}")

    def running(self) -> float:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        text = get(self.url + "/metrics", headers=headers).text
        return float(re.search(r"^llmfw_requests_running (\S+)", text, re.M).group(1))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    serve = ServeProcess(smollm2_path, tmp_path_factory.mktemp("serve") / "output.txt")
    yield serve
    serve.stop()


@pytest.fixture(scope="module")
def key_server(smollm2_path, tmp_path_factory):
    """With an API key, and -v: every request is logged, which must never show the key."""
    serve = ServeProcess(smollm2_path, tmp_path_factory.mktemp("serve-key") / "output.txt", "--api-key", API_KEY,
                         "-v")
    yield serve
    serve.stop()


# -- pages ----------------------------------------------------------------------------------------------------------
class Page:
    """A fresh browser context (empty storage) on the page of ``url``, recording foreign requests and errors."""

    def __init__(self, browser, url: str, **context_options):
        self.url = url
        self.context = browser.new_context(viewport={"width": 1200, "height": 760}, **context_options)
        self.page = self.context.new_page()
        self.page.set_default_timeout(ACTION_MS)
        self.foreign: list[str] = []
        self.errors: list[str] = []
        self.page.on("request", self._request)
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.goto(url + "/")

    def _request(self, request) -> None:
        if not (request.url.startswith(self.url + "/") or request.url.startswith("data:")):
            self.foreign.append(request.url)

    def close(self) -> None:
        self.context.close()
        assert not self.foreign, f"the page asked for something outside its server: {self.foreign}"
        assert not self.errors, f"script errors on the page: {self.errors}"

    # what the tests do on the page
    def settings(self, **fields: str) -> None:
        """Open the settings panel and fill fields by their labels."""
        if self.page.get_attribute("#settings-toggle", "aria-expanded") != "true":
            self.page.click("#settings-toggle")
        for label, value in fields.items():
            self.page.get_by_label(label, exact=True).fill(value)

    def send(self, text: str) -> None:
        self.page.fill("#prompt", text)
        self.page.press("#prompt", "Enter")

    def last_reply(self):
        return self.page.locator(".msg.assistant").last

    def wait_reply(self, state: str = "done"):
        """The last reply once it is in ``state`` (selectors wait without eval, which the page's CSP forbids)."""
        self.page.wait_for_selector(f".msg.assistant:last-of-type[data-state={state}]", timeout=WAIT_MS)
        return self.last_reply()

    def stored_messages(self) -> list[dict]:
        """The messages of the open conversation, as the browser stored them."""
        current = json.loads(self.page.evaluate("localStorage.getItem('llmfw.current')"))
        conversations = json.loads(self.page.evaluate("localStorage.getItem('llmfw.conversations')"))
        return next(c for c in conversations if c["id"] == current)["messages"]


@pytest.fixture
def page(browser, server):
    opened = Page(browser, server.url)
    yield opened
    opened.close()


def artifact(tmp_path: Path, name: str) -> Path:
    """Where a screenshot goes: the test's tmp_path, or $LLMFW_TEST_ARTIFACTS when set (CI keeps those)."""
    folder = Path(os.environ.get("LLMFW_TEST_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


# -- the tests -------------------------------------------------------------------------------------------------------
def test_serve_prints_the_page_url_and_serves_the_page(server):
    assert server.page_line.endswith(f"chat in a browser at http://127.0.0.1:{server.port}/")
    page = get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    assert get(server.url + "/webui/app.js").status_code == 200
    assert get(server.url + "/webui/../__init__.py").status_code == 404
    assert get(server.url + "/webui/nothing.js").json()["error"]["type"] == "not_found_error"


def test_no_webui_leaves_the_page_out(tmp_path):
    from llmfw.commands.serve import serve_pipeline
    from llmfw.core.errors import ConfigError
    from llmfw.serving.app import create_app

    assert serve_pipeline({"webui": False}).config.server.webui is False
    assert serve_pipeline({}).config.server.webui is True

    def no_model():
        raise ConfigError("this test needs no model")

    for webui, status in ((False, 404), (True, 200)):
        live = LiveServer(create_app(no_model, webui=webui))
        try:
            assert get(live.url + "/").status_code == status
            assert get(live.url + "/webui/style.css").status_code == status
        finally:
            live.stop()


def test_every_page_file_ships_in_the_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from fnmatch import fnmatch

    from llmfw.serving.webui import STATIC_DIR

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["llmfw.serving.webui"]
    files = [path.name for path in STATIC_DIR.iterdir()]
    assert "index.html" in files and "app.js" in files
    for name in files:
        assert any(fnmatch(f"static/{name}", pattern) for pattern in patterns), f"{name} would not be installed"


def test_every_control_has_a_label(page):
    p = page.page
    page.settings()
    p.click("#new-chat")
    p.locator(".conversation .rename").click()  # the rename box is a control too
    unlabelled = p.evaluate("""() => [...document.querySelectorAll('input, select, textarea, button')]
        .filter((el) => !((el.labels && el.labels.length) || el.getAttribute('aria-label')
                          || (el.tagName === 'BUTTON' && el.textContent.trim())))
        .map((el) => el.outerHTML)""")
    assert unlabelled == []


def test_a_reply_streams_in_with_counts_and_both_themes(page, server, tmp_path):
    p = page.page
    p.wait_for_selector("#model option[value=smol]", state="attached")
    p.fill("#prompt", "first line")
    p.press("#prompt", "Shift+Enter")
    p.locator("#prompt").press_sequentially("second line")
    assert p.input_value("#prompt") == "first line\nsecond line"  # Shift+Enter: a new line, nothing sent
    assert p.locator(".msg").count() == 0
    # every length the reply's text goes through while it streams in
    p.evaluate("""() => {
        window.replyLengths = [];
        new MutationObserver(() => {
            const reply = document.querySelector('.msg.assistant:last-of-type .content');
            const n = reply ? reply.textContent.length : 0;
            if (n && n !== window.replyLengths.at(-1)) window.replyLengths.push(n);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }""")
    page.settings(**{"Max tokens": "40", "Temperature": "0"})
    page.send("Write a Python function that adds two numbers, in a code block.")
    reply = page.wait_reply()
    lengths = p.evaluate("window.replyLengths")
    # (rendered text, so a closing ** or ``` may shorten it by a few characters on the way)
    assert len(lengths) >= 3 and lengths[-1] > lengths[0] + 10, lengths
    meta = reply.locator(".msg-meta").inner_text()
    assert re.search(r"^\d+ tokens · \d+ prompt tokens · [\d.]+ tokens/s", meta), meta
    stored = page.stored_messages()[1]
    assert stored["usage"]["completion"] == int(meta.split()[0]) and stored["content"].strip()

    themes = {}
    for scheme in ("light", "dark"):
        p.emulate_media(color_scheme=scheme)
        themes[scheme] = p.evaluate("getComputedStyle(document.body).backgroundColor")
        shot = artifact(tmp_path, f"webui-conversation-{scheme}.png")
        p.screenshot(path=str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert themes["light"] != themes["dark"]


def test_stop_cancels_the_request_and_frees_the_slot(page, server):
    p = page.page
    p.wait_for_selector("#model option[value=smol]", state="attached")
    page.send("Tell me a long story about a dragon who learns to bake bread.")
    expect(p.locator(".msg.assistant .content")).not_to_be_empty(timeout=WAIT_MS)
    expect(p.locator("#status-slots")).to_have_text("1 / 2", timeout=WAIT_MS)  # the status view
    assert server.running() == 1
    p.keyboard.press("Escape")
    reply = page.wait_reply("stopped")
    assert "stopped" in reply.locator(".msg-meta").inner_text()
    assert p.is_visible("#send") and not p.is_visible("#stop")
    deadline = time.monotonic() + 5
    while server.running() != 0:
        assert time.monotonic() < deadline, "the slot was still busy 5 s after Stop"
        time.sleep(0.1)
    expect(p.locator("#status-slots")).to_have_text("0 / 2", timeout=5000)
    assert page.stored_messages()[1]["state"] == "stopped"


def test_conversations_survive_a_reload_rename_and_delete(page, server):
    p = page.page
    page.settings(**{"Max tokens": "4"})
    page.send("What is the capital of France?")
    page.wait_reply()
    p.click("#new-chat")
    page.send("Name a color.")
    page.wait_reply()
    p.reload()
    titles = p.locator(".conversation-open")
    assert titles.all_inner_texts() == ["Name a color.", "What is the capital of France?"]
    assert p.locator(".msg.user .content").inner_text() == "Name a color."  # the open one came back too
    titles.nth(1).click()
    assert p.locator(".msg.user .content").inner_text() == "What is the capital of France?"
    assert p.locator(".msg.assistant[data-state=done]").count() == 1

    p.get_by_label('Rename conversation "What is the capital of France?"').click()
    p.get_by_label("New name of the conversation").fill("Geography")
    p.keyboard.press("Enter")
    p.get_by_label('Delete conversation "Name a color."').click()
    p.reload()
    assert p.locator(".conversation-open").all_inner_texts() == ["Geography"]
    assert p.locator(".msg.user .content").inner_text() == "What is the capital of France?"
    assert p.get_by_label("Max tokens", exact=True).input_value() == "4"  # settings are kept as well


def test_json_schema_setting_gives_a_reply_that_validates(page, server):
    p = page.page
    page.settings(**{"JSON schema": "{not json", "Temperature": "0", "Max tokens": "60"})
    page.send("Describe a pet.")
    assert "JSON schema is not valid JSON" in p.locator("#alert").inner_text()
    assert p.locator(".msg").count() == 0 and p.input_value("#prompt") == "Describe a pet."  # nothing sent

    page.settings(**{"JSON schema": json.dumps({"type": "object", "minProperties": "x"})})
    page.send("Describe a pet.")
    page.wait_reply("error")
    alert = p.locator("#alert").inner_text()
    assert "HTTP 400" in alert and "schema" in alert  # the server's own message, shown

    p.click("#new-chat")
    page.settings(**{"JSON schema": json.dumps(PET)})
    page.send("Describe a pet as JSON.")
    reply = page.wait_reply()
    content = page.stored_messages()[1]["content"]
    jsonschema.validate(json.loads(content), PET)
    assert json.loads(reply.locator(".content").inner_text()) == json.loads(content)


def test_an_api_key_server_asks_for_the_key(browser, key_server):
    page = Page(browser, key_server.url)
    try:
        p = page.page
        dialog = p.locator("#key-dialog")
        dialog.wait_for(state="visible")
        assert "needs an API key" in dialog.inner_text()
        p.get_by_role("textbox", name="API key").fill("wrong-key")
        p.click("#key-save")
        expect(p.locator("#key-reason")).to_contain_text("refused", timeout=WAIT_MS)
        p.get_by_role("textbox", name="API key").fill(API_KEY)
        p.click("#key-save")
        p.wait_for_selector("#model option[value=smol]", state="attached")
        assert not dialog.is_visible()
        page.settings(**{"Max tokens": "4"})
        page.send("Hello")
        page.wait_reply()
        assert p.evaluate("JSON.parse(localStorage.getItem('llmfw.apiKey'))") == API_KEY
        p.reload()  # the key is kept in the browser: no question the second time
        p.wait_for_selector("#model option[value=smol]", state="attached")
        expect(p.locator("#status-slots")).to_have_text("0 / 2", timeout=WAIT_MS)
        assert not dialog.is_visible()
        assert API_KEY not in p.url and not page.context.cookies()
    finally:
        page.close()
    key_server.stop()
    log = key_server.log.read_text()
    assert "POST /v1/chat/completions" in log and API_KEY not in log  # requests logged (-v), the key never


def test_a_killed_server_shows_an_error(browser, smollm2_path, tmp_path):
    serve = ServeProcess(smollm2_path, tmp_path / "output.txt")
    page = Page(browser, serve.url)
    try:
        p = page.page
        p.wait_for_selector("#model option[value=smol]", state="attached")
        page.send("Tell me a long story about a lighthouse keeper.")
        expect(p.locator(".msg.assistant .content")).not_to_be_empty(timeout=WAIT_MS)
        serve.proc.kill()  # mid-reply
        serve.proc.wait()
        reply = page.wait_reply("error")
        assert "broke off" in reply.locator(".msg-error").inner_text()
        assert p.is_visible("#alert")
        page.send("Are you there?")
        expect(p.locator("#alert-text")).to_contain_text("Cannot reach the server", timeout=WAIT_MS)
        expect(p.locator("#status-state")).to_have_text("Server unreachable", timeout=WAIT_MS)
        assert p.is_visible("#send")  # ready for the next try, not hanging
    finally:
        page.close()
        serve.stop()


def test_markdown_reasoning_tool_calls_and_copy(browser, server):
    page = Page(browser, server.url)
    try:
        page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
        p = page.page
        html = p.evaluate("""async () => {
            const { renderMarkdown } = await import('/webui/markdown.js');
            return renderMarkdown([
                'Hi **bold** _it_ `a<b>` [site](https://example.com) [bad](javascript:alert(1))',
                '<img src=x onerror="alert(1)">', '', '- one', '- two', '', '```python', 'print("<x>")', '```',
            ].join('\\n'));
        }""")
        assert "<strong>bold</strong>" in html and "<em>it</em>" in html and "<code>a&lt;b&gt;</code>" in html
        assert '<a href="https://example.com"' in html and 'href="javascript' not in html
        assert "<img" not in html and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in html
        assert "<ul><li>one</li><li>two</li></ul>" in html
        assert 'data-lang="python">print(&quot;&lt;x&gt;&quot;)</code>' in html

        # a reply with reasoning and a tool call, folded from chunks shaped as the server streams them
        p.evaluate("""async () => {
            const { applyChunk, messageElement, newReply } = await import('/webui/reply.js');
            const reply = newReply('smol');
            const chunk = (delta, finish = null) => ({choices: [{index: 0, delta, finish_reason: finish}]});
            for (const c of [chunk({role: 'assistant', content: ''}), chunk({reasoning_content: 'Think '}),
                             chunk({reasoning_content: 'first.'}), chunk({content: 'Calling:\\n```js\\nx()\\n```'}),
                             chunk({tool_calls: [{index: 0, id: 'c1', type: 'function',
                                                  function: {name: 'get_weather', arguments: '{"city":'}}]}),
                             chunk({tool_calls: [{index: 0, function: {arguments: ' "Paris"}'}}]}),
                             chunk({}, 'tool_calls'),
                             {choices: [], usage: {prompt_tokens: 9, completion_tokens: 12}}]) {
                applyChunk(reply, c, performance.now());
            }
            reply.state = 'done';
            document.getElementById('messages').append(messageElement(reply));
        }""")
        reply = p.locator(".msg.assistant")
        reasoning = reply.locator("details.reasoning")
        assert reasoning.is_visible() and reasoning.get_attribute("open") is None  # collapsed
        reasoning.locator("summary").click()
        assert reply.locator(".reasoning-body").inner_text() == "Think first."
        call = reply.locator(".tool-call")
        assert call.locator(".badge").text_content() == "Tool call" and "get_weather" in call.inner_text()
        assert json.loads(call.locator("pre").inner_text()) == {"city": "Paris"}
        assert reply.locator(".msg-meta").inner_text().startswith("12 tokens · 9 prompt tokens")
        reply.get_by_label("Copy code").click()
        expect(p.locator(".copy")).to_have_text("Copied", timeout=WAIT_MS)
        assert p.evaluate("navigator.clipboard.readText()") == "x()"
    finally:
        page.close()
