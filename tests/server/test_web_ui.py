"""The chat page at GET / in a real browser: Debian's headless Chromium (/usr/bin/chromium),
driven by playwright, against a real server on a tiny random model.

A conversation streams its replies and shows each reply's prompt and cached tokens; the second
turn, "Regenerate" and "Edit and resend" are served from the prefix cache; server errors are
shown as messages and user text stays text. With --api-key the page loads without the key, asks
for it and keeps it in the tab's sessionStorage; with --disable-web-ui, / is a 404.

The browser tests skip, saying why, where playwright or the browser is not installed
(`.ci/run` installs Debian's chromium when it can; playwright is in the dev extras).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from http_helpers import TINY_OPTIONS, Server, running_server

CHROMIUM = Path("/usr/bin/chromium")
# playwright cannot download its own browser build here: it drives the system's, with nothing
# in the background that would reach the network
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
PAGE_SIZE = 4  # TINY_OPTIONS' --page-size: a cached prefix is whole pages
KEY = "web-ui-s3cret"
TIMEOUT_MS = 60_000
SCRIPT_IN_TEXT = '<img src="x" onerror="window.__pwned = 1"><b>bold?</b>'


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[dev]' installs it)")
    if not CHROMIUM.exists():
        pytest.skip(f"no browser: {CHROMIUM} is missing (apt-get install chromium)")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], tiny_dir: Path) -> Server:
    return start_server(tiny_dir, *TINY_OPTIONS)


def _open(browser: Any, server: Server) -> tuple[Any, Any, list[str]]:
    """A new context (a new session) and page on the chat page; the URLs the page requested."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    requested: list[str] = []
    page.on("request", lambda r: requested.append(r.url))
    page.goto(server.url + "/")
    return context, page, requested


def _settings(page: Any, temperature: str = "0", max_tokens: str = "24") -> None:
    page.fill("#temperature", temperature)
    page.fill("#max-tokens", max_tokens)


def _wait_idle(page: Any) -> None:
    """Until no reply is streaming (the Send button is enabled again)."""
    page.wait_for_function("() => !document.querySelector('#send').disabled && !document.querySelector('[data-state]')")


def _send(page: Any, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    _wait_idle(page)


def _replies(page: Any) -> list[dict[str, Any]]:
    """Each assistant message: its text and the numbers under it."""
    return page.eval_on_selector_all("#messages li.msg.assistant", """nodes => nodes.map(n => {
        const s = n.querySelector('.stats');
        return {text: n.querySelector('.content').textContent,
                prompt: s && s.dataset.promptTokens !== undefined ? Number(s.dataset.promptTokens) : null,
                cached: s && s.dataset.cachedTokens !== undefined ? Number(s.dataset.cachedTokens) : null,
                segment: s && s.dataset.segmentTokens !== undefined ? Number(s.dataset.segmentTokens) : null,
                stats: s ? s.textContent : null};
    })""")


def _errors(page: Any) -> list[str]:
    return page.eval_on_selector_all("#messages li.msg.error .content", "nodes => nodes.map(n => n.textContent)")


def _wait_model(page: Any, name: str) -> None:
    """Until the page has reached /v1/models and shows the served model's name."""
    page.wait_for_function(f"() => document.querySelector('#model').textContent === {json.dumps(name)}")


def test_conversation_streams_and_the_cache_shows(browser, server, tiny_dir, tmp_path):
    assert httpx.post(server.url + "/flush_cache", timeout=30).json()["ok"]  # the first turn is cold
    context, page, requested = _open(browser, server)
    try:
        _wait_model(page, str(tiny_dir))
        _settings(page)
        # every text the reply's node shows, as it changes: a streamed reply grows in steps
        page.evaluate("""() => {
            window.__shown = [];
            new MutationObserver(records => { for (const r of records) for (const n of r.addedNodes)
                if (n.nodeType === Node.TEXT_NODE && n.parentElement && n.parentElement.closest('.msg.assistant'))
                    window.__shown.push(n.data); }).observe(document.querySelector('#messages'),
                {childList: true, subtree: true});
        }""")
        with page.expect_request("**/v1/chat/completions") as sent:
            _send(page, "Hello! Tell me about prefix caching.")
        body = json.loads(sent.value.post_data)
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["temperature"] == 0 and body["max_tokens"] == 24
        assert body["messages"] == [{"role": "user", "content": "Hello! Tell me about prefix caching."}]

        (first,) = _replies(page)
        assert first["text"], "an empty reply"
        shown = [t for t in page.evaluate("window.__shown") if t]
        growing = [t for t in shown if first["text"].startswith(t) and t != first["text"]]
        assert len(set(growing)) >= 2, f"the reply did not appear in steps: {shown}"
        assert first["prompt"] > 0 and first["cached"] == 0, first
        # the page sends plain messages: no segment tokens, and no "segments reused" under the reply
        assert first["segment"] == 0 and "segments reused" not in first["stats"], first
        assert "TTFT" in first["stats"] and "tok/s" in first["stats"] and "ms" in first["stats"], first["stats"]

        _send(page, "And why does it make a second turn faster?")
        first, second = _replies(page)
        assert second["prompt"] > first["prompt"]
        # the second turn's prompt starts with the first's, which the cache kept
        assert second["cached"] >= first["prompt"] - PAGE_SIZE, second
        assert page.locator("#messages li.msg.assistant").last.locator(".cached.hit").count() == 1

        page.locator("#messages li.msg.assistant").last.get_by_role("button", name="Regenerate").click()
        _wait_idle(page)
        replies = _replies(page)
        assert len(replies) == 2 and replies[1]["prompt"] == second["prompt"]
        assert replies[1]["cached"] >= second["prompt"] - PAGE_SIZE, replies[1]  # the same prompt again

        turn = page.locator("#messages li.msg.user").nth(1)
        turn.get_by_role("button", name="Edit and resend").click()
        turn.locator("textarea.edit").fill("Then what is a radix tree?")
        turn.get_by_role("button", name="Send", exact=True).click()
        _wait_idle(page)
        users = page.eval_on_selector_all("#messages li.msg.user .content", "nodes => nodes.map(n => n.textContent)")
        assert users == ["Hello! Tell me about prefix caching.", "Then what is a radix tree?"]
        replies = _replies(page)
        assert len(replies) == 2 and replies[0] == first
        assert replies[1]["cached"] >= first["prompt"] - PAGE_SIZE, replies[1]  # the first turn is shared
        assert "cache served" in page.text_content("#totals")
        assert _errors(page) == []
        shot = tmp_path / "web_ui.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert all(url.startswith(server.url + "/") for url in requested), requested  # nothing from elsewhere
    finally:
        context.close()


def test_server_errors_are_messages_and_text_stays_text(browser, server):
    context, page, _ = _open(browser, server)
    try:
        _settings(page, max_tokens="99999999")
        _send(page, SCRIPT_IN_TEXT)
        (error,) = _errors(page)
        refused = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 99999999, "stream": True})
        assert error == f"400: {refused.json()['error']['message']}"  # the server's own words
        assert page.eval_on_selector_all("#messages li.msg.user .content", "n => n.map(x => x.textContent)") == [SCRIPT_IN_TEXT]
        assert page.locator("#messages img, #messages b").count() == 0
        assert page.evaluate("window.__pwned") is None
        _settings(page, max_tokens="8")
        page.locator("#messages li.msg.error").get_by_role("button", name="Retry").click()
        _wait_idle(page)
        assert _errors(page) == [] and len(_replies(page)) == 1 and _replies(page)[0]["prompt"] > 0
    finally:
        context.close()


def test_with_an_api_key_the_page_asks_for_it_and_keeps_it_in_the_session(browser, tiny_dir, tmp_path):
    with running_server(tiny_dir, *TINY_OPTIONS, "--api-key", KEY, log_dir=tmp_path) as srv:
        for path in ("/", "/web/chat.js", "/web/chat.css"):  # the page holds no secret
            assert httpx.get(srv.url + path).status_code == 200, path
        assert httpx.get(srv.url + "/v1/models").status_code == 401  # what the page calls does need it
        context, page, _ = _open(browser, srv)
        try:
            page.wait_for_selector("#key-form", state="visible")
            assert any("401" in e and "API key" in e for e in _errors(page)), _errors(page)
            page.fill("#api-key", "not-the-key")
            page.click("#save-key")
            page.wait_for_function("() => document.querySelectorAll('#messages li.msg.error').length === 1 "
                                   "&& document.querySelector('#model').textContent === 'not connected'")
            assert page.is_visible("#key-form")
            page.fill("#api-key", KEY)
            page.click("#save-key")
            page.wait_for_selector("#key-form", state="hidden")
            _wait_model(page, str(tiny_dir))
            assert page.evaluate("sessionStorage.getItem('radixserve.apiKey')") == KEY
            assert page.evaluate("localStorage.length") == 0
            _settings(page)
            _send(page, "Hi with a key")
            assert _errors(page) == [] and _replies(page)[0]["prompt"] > 0
            page.reload()  # the same tab keeps its session
            _wait_model(page, str(tiny_dir))
            assert not page.is_visible("#key-form") and KEY not in page.content()
        finally:
            context.close()
        context, page, _ = _open(browser, srv)  # a new session knows no key
        try:
            page.wait_for_selector("#key-form", state="visible")
        finally:
            context.close()


def test_the_page_is_served_with_its_headers(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
    assert "http" not in r.text.replace(server.url, "")  # every file the page loads is this server's
    for path, kind in (("/web/chat.js", "text/javascript"), ("/web/chat.css", "text/css")):
        asset = httpx.get(server.url + path)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind), path
    assert httpx.head(server.url + "/").status_code == 200
    assert httpx.post(server.url + "/").status_code == 405
    assert httpx.get(server.url + "/web/").status_code == 404


def test_disable_web_ui_leaves_no_page(tiny_dir, tmp_path):
    with running_server(tiny_dir, *TINY_OPTIONS, "--disable-web-ui", log_dir=tmp_path) as srv:
        for path in ("/", "/web/chat.js", "/web/chat.css"):
            r = httpx.get(srv.url + path)
            assert r.status_code == 404 and r.json()["error"]["message"] == f"no route {path}", path
        assert httpx.get(srv.url + "/v1/models").status_code == 200
        assert srv.info()["options"]["disable_web_ui"] is True
