"""The web page at / of `minisgl serve`, driven in headless Chromium (Debian's `chromium`, through Playwright).

One browser for the module; each test opens a fresh context (no shared storage) on a real uvicorn server around
the shared engine, and checks what a user sees: the streamed answer, the stop button aborting the request (seen
in /metrics), the live pane's counters moving during a burst, the API-key prompt, the image tab. Every request
the page makes must go to the server itself (the page works offline).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx
import pytest
from server_fixtures import API_KEY, _serve, wait_idle

from minisgl_cli.media.settings import MediaSettings
from minisgl_cli.server.settings import ServerSettings

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FRANCE = "What is the capital of France?"
TIMEOUT_MS = 60_000
serving = contextmanager(_serve)  # a server on the shared engine with these settings, for one test


def _metrics(url: str) -> dict:
    return httpx.get(f"{url}/metrics", timeout=30).json()


def _until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


# --- no browser needed -------------------------------------------------------------------------------------
def test_no_web_leaves_the_page_and_its_poll_route_out(engine_client):
    with serving(ServerSettings(web=False)) as url:
        for path in ("/", "/web/app.js", "/metrics/live"):
            r = httpx.get(f"{url}{path}")
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", path
        assert httpx.get(f"{url}/health").status_code == 200


def test_serve_flag_and_env_var_turn_the_page_off(monkeypatch):
    """--no-web and MINISGL_WEB=0 reach ServerSettings.web; the page is on by default."""
    from typer.testing import CliRunner

    from commands.common import EngineOptions
    from minisgl_cli.app import app

    seen: list[ServerSettings] = []
    monkeypatch.setattr(EngineOptions, "client", lambda self: None)
    monkeypatch.setattr("minisgl_cli.server.launch.serve", lambda client, settings, launch: seen.append(settings))
    for args, env in (([], {}), (["--no-web"], {}), ([], {"MINISGL_WEB": "0"})):
        result = CliRunner().invoke(app, ["serve", *args], env=env)
        assert result.exit_code == 0, result.output
    assert [s.web for s in seen] == [True, False, False]


def test_page_files_ship_in_the_package_and_load_without_the_key(auth_url):
    """GET / and the page's files need no key and hold none; the page forbids loading from elsewhere (CSP)."""
    r = httpx.get(auth_url)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    for path in ("/web/app.js", "/web/style.css"):
        assert httpx.get(f"{auth_url}{path}").status_code == 200
    assert API_KEY not in r.text
    assert httpx.get(f"{auth_url}/metrics/live").status_code == 401
    assert httpx.get(f"{auth_url}/web/secret.txt").status_code == 401  # only the page's own files are open


# --- in the browser ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser() -> Iterator:
    if not CHROMIUM:
        if os.environ.get("MINISGL_REQUIRE_BROWSER"):
            pytest.fail("MINISGL_REQUIRE_BROWSER is set but no chromium is installed")
        pytest.skip("no system chromium: install Debian's `chromium` (`bash .ci/run` does) to run the browser tests")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
    sync_api.expect.set_options(timeout=TIMEOUT_MS)  # a busy 2-core machine answers in seconds, not 5 s
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM)
        yield b
        b.close()


class Page:
    """A fresh browser context on one server: the Playwright page, and every request it made."""

    def __init__(self, browser, url: str):
        self.url = url
        self.context = browser.new_context(viewport={"width": 1280, "height": 800})
        self.page = self.context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        self.requests: list = []
        self.errors: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r))
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))

    def open(self, query: str = "?interval=0.25") -> Page:
        self.page.goto(f"{self.url}/{query}")
        return self

    def number(self, element_id: str) -> float:
        return float(self.page.inner_text(f"#{element_id}").replace(",", "").rstrip("%"))

    def wait_number(self, element_id: str, js_condition: str) -> None:
        """Until the number shown in #element_id satisfies `x => condition`."""
        self.page.wait_for_function(
            f"() => {{ const x = parseFloat(document.getElementById('{element_id}').textContent.replace(/,/g, ''));"
            f" return {js_condition}; }}")

    def close(self) -> None:
        self.context.close()
        origin = urlsplit(self.url).netloc
        outside = [r.url for r in self.requests if urlsplit(r.url).netloc != origin]
        assert not outside, f"the page loaded from outside the server: {outside}"
        assert not self.errors, f"JavaScript errors: {self.errors}"


@pytest.fixture
def web(browser, server_url) -> Iterator[Page]:
    p = Page(browser, server_url).open()
    yield p
    p.close()


def _send(page, text: str):
    """Type a prompt and press Enter; returns the chat request's JSON body."""
    page.fill("#prompt", text)
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as req:
        page.press("#prompt", "Enter")
    return req.value.post_data_json


@pytest.mark.slow
def test_typed_prompt_streams_the_answer_and_the_next_turn_carries_the_history(web):
    from playwright.sync_api import expect

    page = web.page
    expect(page.locator("#conn")).to_have_text("live")
    # Count the answer's text updates: a streamed answer grows piece by piece.
    page.evaluate("""() => { window.updates = 0; new MutationObserver(() => window.updates++)
        .observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true}); }""")
    body = _send(page, FRANCE)
    assert body["stream"] is True and body["messages"] == [{"role": "user", "content": FRANCE}]
    answer = page.locator(".msg.assistant").last
    expect(answer).to_have_attribute("data-finish", "stop")
    first = answer.locator(".text").inner_text()
    assert "Paris" in first
    assert page.evaluate("window.updates") > 3  # several pieces, not one block at the end
    assert "tokens" in answer.locator(".meta").inner_text() and "TTFT" in answer.locator(".meta").inner_text()

    # Second turn: the system prompt, temperature and max tokens from the settings; the history comes along.
    page.fill("#system", "You are a geography teacher.")
    page.fill("#temperature", "0.7")
    page.fill("#max-tokens", "5")
    body = _send(page, "And of Italy?")
    assert body["messages"] == [
        {"role": "system", "content": "You are a geography teacher."}, {"role": "user", "content": FRANCE},
        {"role": "assistant", "content": first}, {"role": "user", "content": "And of Italy?"}]
    assert body["temperature"] == 0.7 and body["max_tokens"] == 5
    answer = page.locator(".msg.assistant").nth(1)
    expect(answer).to_have_attribute("data-finish", "length")
    assert answer.locator(".meta").inner_text().startswith("5 tokens")

    page.click("#new-chat")
    expect(page.locator(".msg")).to_have_count(0)


@pytest.mark.slow
def test_stop_aborts_the_request_and_metrics_show_it(web, engine_client):
    from playwright.sync_api import expect

    page = web.page
    expect(page.locator("#conn")).to_have_text("live")
    before = _metrics(web.url)
    aborted_shown = web.number("m-aborted")
    page.fill("#max-tokens", "2000")
    _send(page, "Write a very long story about a dragon who learns to bake bread.")
    text = page.locator(".msg.assistant .text").last
    page.wait_for_function("() => document.querySelector('.msg.assistant .text').textContent.length > 40")
    expect(page.locator("#stop")).to_be_enabled()
    page.click("#stop")
    answer = page.locator(".msg.assistant").last
    expect(answer).to_have_attribute("data-finish", "stopped")
    expect(page.locator("#send")).to_be_enabled()
    shown = text.inner_text()

    # The server saw the stream closed and aborted the engine request: /metrics says so, and so does the page.
    def aborted() -> bool:
        m = _metrics(web.url)
        return (m["server"]["disconnects"] > before["server"]["disconnects"]
                and m["server"]["finished"].get("abort", 0) > before["server"]["finished"].get("abort", 0)
                and m["scheduler"]["aborted_requests"] > before["scheduler"]["aborted_requests"])

    _until(aborted)
    web.wait_number("m-aborted", f"x > {aborted_shown}")
    expect(page.locator("#recent tbody tr").first.locator("td").nth(2)).to_have_text("abort")
    wait_idle(engine_client)
    engine_client.check_pages()
    assert engine_client.stats().tokens_in_use == 0
    assert shown and not answer.evaluate("el => el.classList.contains('error')")


@pytest.mark.slow
def test_live_pane_counters_move_during_a_burst(web):
    from playwright.sync_api import expect

    page = web.page
    expect(page.locator("#conn")).to_have_text("live")
    finished = web.number("m-finished")
    newest = page.evaluate("() => Number(document.querySelector('#recent tbody td')?.textContent || 0)")
    body = {"model": "default", "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": 48, "ignore_eos": True}

    def one(i: int) -> None:
        r = httpx.post(f"{web.url}/v1/chat/completions", json={**body, "seed": i}, timeout=120)
        assert r.status_code == 200

    burst = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in burst:
        t.start()
    try:
        web.wait_number("m-running", "x >= 2")  # the batch, as the scheduler runs it
        web.wait_number("m-kv-used", "x > 0")
        web.wait_number("m-decode", "x > 0")
        assert page.locator("#m-step").inner_text() == "(eager step)"  # the suite's CPU decode: --torch-compile off
    finally:
        for t in burst:
            t.join()
    web.wait_number("m-finished", f"x >= {finished + 6}")
    web.wait_number("m-running", "x === 0")
    # The table lists the burst as the server front saw each request end (a moment after the scheduler did).
    page.wait_for_function(f"() => Number(document.querySelector('#recent tbody td').textContent) >= {newest + 6}")
    cells = page.locator("#recent tbody tr").first.locator("td").all_inner_texts()
    assert cells[1] == "/v1/chat/completions"  # the API it came through
    assert cells[2] == "length" and cells[5] == "48" and float(cells[6]) > 0 and float(cells[7]) > 0  # TTFT, TPOT
    # The plots were drawn: the canvas has non-background pixels.
    assert page.evaluate("""() => { const c = document.getElementById('plot-decode');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        for (let i = 0; i < d.length; i += 4) if (d[i + 3] && d[i + 2] > d[i] + 60) return true; return false; }""")


@pytest.mark.slow
def test_api_key_is_asked_once_and_sent_as_a_bearer_header(browser, auth_url):
    from playwright.sync_api import expect

    web = Page(browser, auth_url).open()
    try:
        page = web.page
        expect(page.locator("#key-overlay")).to_be_visible()
        page.fill("#key-input", "wrong-key")
        page.click("#key-submit")
        expect(page.locator("#key-error")).to_have_text("That key was refused.")
        expect(page.locator("#key-overlay")).to_be_visible()
        page.fill("#key-input", API_KEY)
        page.click("#key-submit")
        expect(page.locator("#conn")).to_have_text("live")
        expect(page.locator("#key-overlay")).to_be_hidden()
        page.fill("#max-tokens", "16")
        _send(page, FRANCE)
        expect(page.locator(".msg.assistant").last).to_have_attribute("data-finish", "stop")
        assert "Paris" in page.locator(".msg.assistant .text").last.inner_text()

        page.reload()  # once per tab: the key is kept for the session
        expect(page.locator("#conn")).to_have_text("live")
        expect(page.locator("#key-overlay")).to_be_hidden()
        api = [r for r in web.requests if "/v1/" in r.url or "/metrics/" in r.url]
        keyed = [r.headers.get("authorization") for r in api]
        assert keyed[0] is None and keyed[-1] == f"Bearer {API_KEY}"
        assert any(r.url.endswith("/v1/chat/completions") for r in api)
        assert all(k == f"Bearer {API_KEY}" for r, k in zip(api, keyed) if r.url.endswith("/v1/chat/completions"))
    finally:
        web.close()


@pytest.mark.slow
def test_image_tab_only_with_an_image_model(browser, web, tiny_models):
    from playwright.sync_api import expect

    expect(web.page.locator("#model")).not_to_be_empty()
    expect(web.page.locator("#image-tab")).to_be_hidden()  # the default server has no image model
    with serving(ServerSettings(media=MediaSettings(image_model_dir=tiny_models["z-image"]))) as url:
        images = Page(browser, url).open()
        try:
            page = images.page
            page.click("#image-tab")
            page.fill("#image-prompt", "a red lantern")
            page.fill("#image-size", "48x32")
            page.fill("#image-steps", "2")
            page.fill("#image-seed", "5")
            page.click("#image-go")
            img = page.locator("#images img")
            expect(img).to_have_count(1)
            expect(page.locator("#image-status")).to_contain_text("48x32")  # done: the previews replaced
            page.wait_for_function("() => document.querySelector('#images img').complete")
            assert img.evaluate("im => [im.naturalWidth, im.naturalHeight]") == [48, 32]
        finally:
            images.close()


def test_a_wheel_ships_the_page(tmp_path):
    """pyproject's package-data puts every file of server/web/ into the wheel, so `pip install` serves the page."""
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    from minisgl_cli.server.web import WEB_DIR

    repo = Path(__file__).resolve().parents[1]
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(repo / name, src / name)
    for name in ("minisgl_cli", "commands"):
        shutil.copytree(repo / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("minisgl-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    page = {f"minisgl_cli/server/web/{f.name}" for f in WEB_DIR.iterdir()}
    assert page and page <= shipped, page - shipped
