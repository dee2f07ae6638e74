"""The playground and the offline docs in a real headless browser (Debian's chromium driven
by Playwright), against real servers on the shipped weights, with every request to another
host blocked: streaming, Stop, fork, export/import, errors, the API-key flow, /docs and
/redoc offline, security headers, an axe-core audit, and no console errors anywhere."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.serverproc import ServerProcess
from tests.paths import ROOT

pytestmark = pytest.mark.integration
AXE = ROOT / "tests" / "assets" / "axe.min.js"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _need_browser() -> None:
    """Skip without chromium on a developer's machine; fail in CI, which installs it."""
    missing = CHROMIUM is None
    try:
        import playwright  # noqa: F401
    except ImportError:
        missing = True
    if missing:
        if os.environ.get("CI"):
            pytest.fail("chromium and playwright are needed (CI installs them)")
        pytest.skip("chromium or playwright is not installed")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    _need_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


class Page:
    """A page on ``base`` that may only reach the server itself, and records console errors."""

    def __init__(self, browser: Any, base: str, **context: Any) -> None:
        self.context = browser.new_context(accept_downloads=True, **context)
        self.errors: list[str] = []
        self.blocked: list[str] = []
        self.context.route("**/*", self._only_local)
        self.page = self.context.new_page()
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.base = base

    def _only_local(self, route: Any) -> None:
        if route.request.url.startswith(self.base):
            route.continue_()
        else:
            self.blocked.append(route.request.url)
            route.abort()

    def open(self, path: str = "/") -> Any:
        self.page.goto(self.base + path)
        return self.page

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser: Any, server: ServerProcess) -> Iterator[Any]:
    p = Page(browser, server.url)
    p.open()
    wait_until(p.page, MODEL_SHOWN)
    yield p.page
    allowed = EXPECTED_ERRORS.pop(id(p.page), None)
    errors = [e for e in p.errors if allowed is None or allowed not in e]
    p.close()
    assert errors == [], errors  # no console errors on any page


# A test that provokes an HTTP error on purpose names the console line it expects here.
EXPECTED_ERRORS: dict[int, str] = {}


def wait_until(page: Any, js: str, timeout: float = 30.0) -> None:
    """Poll a JavaScript expression until it is truthy (``wait_for_function`` compiles its
    predicate with eval, which the page's CSP rightly forbids)."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(js):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {js}")
        time.sleep(0.05)


MODEL_SHOWN = "document.getElementById('model').textContent.includes('Model')"


def set_field(page: Any, field: str, value: str) -> None:
    page.fill(f"#{field}", value)


def generate(page: Any, timeout: float = 60_000) -> None:
    page.click("#generate")
    page.wait_for_selector("#generate:not([disabled])", timeout=timeout)


def pane_outputs(page: Any) -> list[str]:
    """The generated text of each pane's last request."""
    return [str(t) for t in page.eval_on_selector_all(
        ".pane", "ps => ps.map(p => { const g = p.querySelectorAll('.generated'); "
        "return g.length ? g[g.length - 1].textContent : ''; })")]


def running_requests(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(r"^linserve_num_requests_running (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]


def test_text_streams_in_incrementally(page: Any) -> None:
    set_field(page, "max_tokens", "200")
    page.evaluate("""() => {
        window.lengths = [];
        new MutationObserver(() => {
            const g = document.querySelector('.generated');
            if (g) window.lengths.push(g.textContent.length);
        }).observe(document.getElementById('panes'),
                   {subtree: true, childList: true, characterData: true});
    }""")
    generate(page)
    lengths = page.evaluate("window.lengths")
    assert len(set(lengths)) >= 10, lengths  # many partial renders, not one final blob
    assert lengths == sorted(lengths)
    stats = page.inner_text(".pane .stats")
    assert "TTFT" in stats and "Tokens/s" in stats and "Tokens in session" in stats
    assert "296.0 KiB" in stats  # the linear state


def disconnects(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    found = re.search(r"^linserve_client_disconnects_total (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _stop_one_run(page: Any, url: str) -> bool:
    """Start a long run, press Stop while the server is generating it, and wait until the
    page and the server are idle again. True when the click cancelled a live request: the
    pane says so and the server counted one disconnect. False when the run finished before
    the click landed (a loaded machine can render the stream well behind the server)."""
    before = disconnects(url)
    marks = page.inner_text(".pane .output").count("[stopped]")
    page.click("#generate")
    wait_until(page, "(document.querySelector('.generated') || {textContent: ''})"
               ".textContent.length > 40 || !document.getElementById('generate').disabled")
    if page.is_enabled("#stop-button") and running_requests(url) >= 1:
        page.click("#stop-button")
    page.wait_for_selector("#generate:not([disabled])", timeout=120_000)
    deadline = time.monotonic() + 10
    while (running_requests(url) > 0 or disconnects(url) == before) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running_requests(url) == 0
    stopped = page.inner_text(".pane .output").count("[stopped]") == marks + 1
    cancelled = disconnects(url) - before
    assert cancelled in (0, 1)
    return stopped and cancelled == 1


def test_stop_cancels_on_the_server(page: Any, server: ServerProcess) -> None:
    # 8,000 tokens: seconds of generation; a run that ends before the click lands is
    # repeated (up to three times) so the click always hits a running request
    set_field(page, "max_tokens", "8000")
    assert any(_stop_one_run(page, server.url) for _ in range(3))


def test_fork_shows_two_different_branches(page: Any) -> None:
    set_field(page, "max_tokens", "24")
    set_field(page, "seed", "7")
    generate(page)
    page.click("#fork-session")
    page.wait_for_selector(".pane >> nth=1")
    assert page.inner_text(".pane >> nth=0").split("\n")[1:3] == \
        page.inner_text(".pane >> nth=1").split("\n")[1:3]  # the fork starts as a copy
    page.fill("#prompt", "\n")
    generate(page)
    a, b = pane_outputs(page)
    assert a and b and a != b  # seeds 7 and 8 from the same state
    titles = page.eval_on_selector_all(".pane-title", "ts => ts.map(t => t.textContent)")
    assert titles == ["Branch A", "Branch B (fork)"]


def test_export_then_import_continues_identically(page: Any, tmp_path: Path) -> None:
    set_field(page, "temperature", "0")
    set_field(page, "max_tokens", "16")
    generate(page)
    with page.expect_download() as info:
        page.click("#export-session")
    saved = tmp_path / info.value.suggested_filename
    info.value.save_as(saved)
    assert saved.suffix == ".safetensors" and saved.stat().st_size > 100_000
    page.fill("#prompt", "")
    generate(page)
    original = pane_outputs(page)[0]
    page.set_input_files("#import-file", str(saved))
    page.wait_for_selector(".pane-title:text('Imported session')")
    generate(page)
    assert pane_outputs(page)[0] == original and original


def test_a_bad_parameter_shows_the_servers_message(page: Any, server: ServerProcess) -> None:
    EXPECTED_ERRORS[id(page)] = "status of 400"  # the browser logs the failed request
    set_field(page, "temperature", "5")
    generate(page)
    shown = page.inner_text("#error")
    body = {"prompt": "a", "temperature": 5}
    expected = httpx.post(server.url + "/v1/completions", json=body).json()["error"]["message"]
    assert shown == expected and "temperature" in shown


def test_chat_mode_streams_a_conversation(page: Any) -> None:
    page.check("input[value=chat]")
    page.uncheck("#use-session")
    set_field(page, "max_tokens", "20")
    page.fill("#prompt", "Who art thou?")
    generate(page)
    page.fill("#prompt", "And whence comest thou?")
    generate(page)
    text = page.inner_text(".pane .output")
    assert text.count("You:") == 2 and text.count("Assistant:") == 2
    cached = re.search(r"(\d+) of (\d+)", page.inner_text(".pane .stats"))
    assert cached is not None and int(cached.group(1)) > 0  # the resent history hit the cache


def test_accessibility_audit_and_phone_width(browser: Any, server: ServerProcess,
                                             tmp_path: Path) -> None:
    p = Page(browser, server.url, bypass_csp=True)  # only to inject the vendored axe-core
    page = p.open()
    wait_until(page, MODEL_SHOWN)
    page.add_script_tag(path=str(AXE))
    result = page.evaluate("async () => (await axe.run(document)).violations.map("
                           "v => v.id + ': ' + v.help + ' ' + v.nodes.length)")
    assert result == []
    page.set_viewport_size({"width": 390, "height": 844})
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # no sideways scroll
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.tagName") in ("A", "INPUT", "BUTTON")
    page.screenshot(path=str(tmp_path / "phone.png"), full_page=True)
    assert p.errors == [] and p.blocked == []
    p.close()


def test_docs_and_redoc_render_offline(browser: Any, server: ServerProcess) -> None:
    p = Page(browser, server.url)
    page = p.open("/docs")
    page.wait_for_selector(".opblock-summary", timeout=30_000)
    operations = page.eval_on_selector_all(".opblock-summary-path", "e => e.length")
    assert operations >= 10
    page = p.open("/redoc")
    page.wait_for_selector("text='/v1/chat/completions'", timeout=30_000)
    assert p.blocked == [] and p.errors == []
    p.close()


def test_security_headers_and_closed_cors(server: ServerProcess) -> None:
    r = httpx.get(server.url + "/")
    csp = r.headers["content-security-policy"]
    assert "unsafe-eval" not in csp and "unsafe-inline" not in csp
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    js = httpx.get(server.url + "/playground/app.js")
    assert js.status_code == 200 and js.headers["x-content-type-options"] == "nosniff"
    pre = httpx.options(server.url + "/v1/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in pre.headers
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js"):
        assert httpx.get(f"{server.url}/static/docs/{asset}").status_code == 200


def test_api_key_flow(browser: Any, linear_weights: Path) -> None:
    key = "pg-secret-4242"
    with ServerProcess(linear_weights, env={"LINSERVE_API_KEYS": key}) as srv:
        p = Page(browser, srv.url)
        page = p.open()
        page.wait_for_selector("#auth:not([hidden])")
        assert "API key" in page.inner_text("#auth")
        page.fill("#api-key", key)
        page.click("#auth-form button[type=submit]")
        wait_until(page, MODEL_SHOWN)
        assert page.is_hidden("#auth")
        assert page.evaluate("sessionStorage.getItem('linserve.apiKey')") == key
        set_field(page, "max_tokens", "8")
        generate(page)
        assert pane_outputs(page)[0]
        assert key not in page.url
        p.errors = [e for e in p.errors if "401" not in e]  # the first, keyless call
        assert p.errors == []
        p.close()
        assert key not in srv.logs()


def test_an_image_is_sent_and_shown_in_the_transcript(browser: Any, tmp_path: Path) -> None:
    """A vision-language model: the image control appears, an attached picture shows in
    the transcript and reaches the model (its tokens counted in the prompt)."""
    from tests.model.qwen_fixtures import make_checkpoint
    from tests.model.vision_fixtures import picture

    model = make_checkpoint(tmp_path / "vl", "i4-tied", vision=True)
    (tmp_path / "cat.png").write_bytes(picture(100, 150, 3))
    with ServerProcess.serving(model) as srv:
        p = Page(browser, srv.url)
        page = p.open()
        wait_until(page, MODEL_SHOWN)
        page.check("input[value=chat]")
        page.uncheck("#use-session")
        set_field(page, "max_tokens", "5")
        assert page.is_visible("#image-file")
        page.set_input_files("#image-file", str(tmp_path / "cat.png"))
        wait_until(page, "document.querySelectorAll('#attached img').length === 1")
        page.fill("#prompt", "What is this?")
        generate(page)
        assert page.eval_on_selector_all(".pane .turn img.thumb", "xs => xs.length") == 1
        assert page.eval_on_selector_all("#attached img", "xs => xs.length") == 0
        cached = re.search(r"(\d+) of (\d+)", page.inner_text(".pane .stats"))
        assert cached is not None and int(cached.group(2)) > 20  # the picture's tokens
        assert p.errors == []
        p.close()
