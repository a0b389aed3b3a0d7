"""The chat page in headless Chromium against a daemon on the default model: streaming, markdown that renders
but never runs, stop, conversations that survive a reload, settings that reach the request."""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest
from daemon_harness import LONG, MODEL, ended_by_abort, mid_stream, outcomes

STATIC = ("/static/chat.js", "/static/chat.css", "/static/vendor/marked.umd.js", "/static/vendor/purify.min.js")
CHROMIUM = "/usr/bin/chromium"
MARKDOWN_REPLY = ("Here is **bold** and a list:\n\n- one\n- two\n\n```python\nprint('hi')\n```\n\n"
                  "<script>window.pwned = 1</script><img src=x onerror=\"window.pwned = 2\">"
                  "[link](javascript:window.pwned=3)")


def test_page_and_assets_are_served_locally(daemon):
    r = httpx.get(f"{daemon.url}/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert not re.search(r"(src|href)=\"https?:", r.text)  # no CDN
    for path in STATIC:
        asset = httpx.get(daemon.url + path)
        assert asset.status_code == 200 and len(asset.text) > 1000, path
    assert "/v1/chat/completions" in httpx.get(daemon.url + "/static/chat.js").text


@pytest.fixture
def page(daemon):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        # bypass_csp lets the test evaluate its own expressions; it also means the page's sanitizer, not its
        # Content-Security-Policy, is what keeps a reply's <script> from running here.
        context = browser.new_context(bypass_csp=True, viewport={"width": 1200, "height": 800})
        try:
            page = context.new_page()
            page.goto(daemon.url + "/")
            page.wait_for_function(f"document.getElementById('model').textContent.includes('{MODEL}')")
            yield page
        finally:
            browser.close()


def sse(chunks: list[str]) -> str:
    events = [{"id": "x", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
               "choices": [{"index": 0, "delta": {"content": c}, "finish_reason": None}]} for c in chunks]
    events.append({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": MODEL, "choices": [],
                   "usage": {"prompt_tokens": 9, "completion_tokens": len(chunks), "total_tokens": 9 + len(chunks)}})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def with_body(**extra):
    """A route handler that adds fields to the page's request body before it goes to the daemon."""
    def handle(route):
        route.continue_(post_data=json.dumps({**json.loads(route.request.post_data), **extra}))
    return handle


STREAMING_LENGTH = "document.querySelector('.assistant[data-state=streaming]')?.textContent.length"


def test_streams_a_reply_with_stats(page):
    page.route("**/v1/chat/completions", with_body(max_tokens=200, ignore_eos=True))
    send(page, "Hello, who are you?")
    page.wait_for_selector(".assistant[data-state=done]", timeout=60_000)
    assert page.inner_text(".assistant").strip()
    stats = page.inner_text(".stats")
    assert "tokens/s" in stats and "TTFT" in stats and "completion tokens" in stats
    send(page, "And then?")
    page.wait_for_function("document.querySelectorAll('.assistant[data-state=done]').length == 2", timeout=60_000)
    assert page.locator(".user").count() == 2


def test_markdown_renders_as_elements_and_never_runs(page):
    pieces = [MARKDOWN_REPLY[i:i + 9] for i in range(0, len(MARKDOWN_REPLY), 9)]  # streamed in small chunks
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"content-type": "text/event-stream"}, body=sse(pieces)))
    send(page, "show me markdown")
    page.wait_for_selector(".assistant[data-state=done]")
    reply = page.locator(".assistant").last
    assert reply.locator("strong").inner_text() == "bold"
    assert reply.locator("li").count() == 2
    assert "print('hi')" in reply.locator("pre code").inner_text()
    assert reply.locator("pre button.copy").count() == 1
    assert "**bold**" not in reply.inner_text()  # rendered, not shown as raw text
    assert reply.locator("script").count() == 0 and reply.locator("img[onerror]").count() == 0
    hrefs = reply.locator("a").evaluate_all("links => links.map(a => a.getAttribute('href') || '')")
    assert not any(h.lower().startswith("javascript") for h in hrefs)
    page.wait_for_timeout(200)
    assert page.evaluate("window.pwned") is None


def test_a_reply_grows_on_the_page_while_it_streams(page):
    """Shown as it arrives, not at the end: the streaming reply is seen at one length and later at a longer one.
    (A 200-token reply can reach a loaded browser in one read, so only a long one says this.)"""
    page.route("**/v1/chat/completions", with_body(**LONG))
    send(page, "Tell me a long story.")
    page.wait_for_function(f"{STREAMING_LENGTH} > 20", timeout=60_000)
    seen = page.evaluate(STREAMING_LENGTH)
    page.wait_for_function(f"{STREAMING_LENGTH} > {seen}", timeout=60_000)
    page.keyboard.press("Escape")  # stops the reply if it still runs; unlike a click, no race with its end
    page.wait_for_selector(".assistant[data-state=done]")


def test_stop_aborts_the_request_on_the_server(page, daemon):
    """Stop ends the reply on the page and aborts the request in the engine: counted as an abort, not as finished
    by its length. A stream whose engine side ended before the click proves nothing, so it is tried again."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.route("**/v1/chat/completions", with_body(**LONG))

    def attempt() -> bool:
        before = outcomes(daemon)
        page.click("#new-chat")
        send(page, "Tell me everything.")
        page.wait_for_function(f"{STREAMING_LENGTH} > 20", timeout=60_000)
        try:
            page.click("#stop", timeout=5_000)
        except PlaywrightTimeout:  # the reply ended first: #send is back where #stop was
            assert "stopped" not in page.locator(".stats").last.inner_text()
            return False
        page.wait_for_selector(".assistant[data-state=done]")
        assert "stopped" in page.locator(".stats").last.inner_text() and page.is_visible("#send")
        return ended_by_abort(daemon, before)

    mid_stream(attempt)


def test_conversations_survive_a_reload_and_can_be_renamed_and_deleted(page):
    send(page, "First conversation")
    page.wait_for_selector(".assistant[data-state=done]", timeout=60_000)
    page.click("#new-chat")
    send(page, "Second conversation")
    page.wait_for_selector(".assistant[data-state=done]", timeout=60_000)
    page.reload()
    page.wait_for_selector("#conversations li")
    titles = page.locator("#conversations .open").all_inner_texts()
    assert titles == ["Second conversation", "First conversation"]
    assert page.inner_text(".user") == "Second conversation" and page.locator(".assistant").count() == 1
    page.locator("#conversations li").nth(1).locator(".open").click()
    assert page.inner_text(".user") == "First conversation"
    page.locator("#conversations li").nth(1).locator(".rename").click()
    page.fill("#conversations input", "Renamed")
    page.press("#conversations input", "Enter")
    page.reload()
    page.wait_for_selector("#conversations li")
    assert "Renamed" in page.locator("#conversations .open").all_inner_texts()
    page.locator("#conversations li", has_text="Second conversation").locator(".delete").click()
    assert page.locator("#conversations .open").all_inner_texts() == ["Renamed"]


def test_settings_reach_the_request_and_regenerate_and_edit_resend(page):
    page.click("#toggle-settings")
    page.fill("#set-system", "Answer tersely.")
    page.fill("#set-temperature", "0.3")
    page.fill("#set-top-p", "0.9")
    page.fill("#set-max-tokens", "17")
    page.fill("#set-seed", "42")
    bodies = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith("/chat/completions")
            else None)
    send(page, "Hello")
    page.wait_for_selector(".assistant[data-state=done]", timeout=60_000)
    body = bodies[-1]
    assert body["messages"] == [{"role": "system", "content": "Answer tersely."}, {"role": "user", "content": "Hello"}]
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (0.3, 0.9, 17, 42)
    assert body["stream"] is True
    first = page.inner_text(".assistant")
    page.click(".regenerate")
    page.wait_for_function("document.querySelectorAll('.assistant[data-state=done]').length == 1 && "
                           "!document.querySelector('.assistant[data-state=streaming]') && "
                           "document.querySelector('.regenerate')", timeout=60_000)
    assert len(bodies) == 2 and bodies[1]["messages"] == body["messages"]
    assert page.inner_text(".assistant") == first  # seeded: the same reply again
    page.click(".actions button")  # edit the last user message
    page.fill(".edit-box textarea", "Hello again")
    page.press(".edit-box textarea", "Enter")
    page.wait_for_function("document.querySelectorAll('.assistant[data-state=done]').length == 1 && "
                           "document.querySelector('.regenerate')", timeout=60_000)
    assert bodies[-1]["messages"][-1] == {"role": "user", "content": "Hello again"} and len(bodies[-1]["messages"]) == 2
    page.reload()
    page.click("#toggle-settings")
    assert page.input_value("#set-max-tokens") == "17" and page.input_value("#set-system") == "Answer tersely."


def test_narrow_window_and_context_notice(page, daemon):
    page.set_viewport_size({"width": 380, "height": 760})
    assert not page.is_visible("#sidebar .open") or page.locator("#sidebar").bounding_box()["x"] < 0
    page.click("#toggle-sidebar")
    page.wait_for_timeout(300)
    assert page.locator("#sidebar").bounding_box()["x"] >= 0
    page.click("#new-chat")
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"content-type": "text/event-stream"}, body=sse(["long ", "reply"]).replace(
            '"prompt_tokens": 9', '"prompt_tokens": 4000')))
    send(page, "fill the context")
    page.wait_for_selector("#notice:not([hidden])")
    assert "of context" in page.inner_text("#notice")
