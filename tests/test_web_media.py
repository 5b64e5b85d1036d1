"""The web page's Image tab and media live view in headless Chromium (the fixtures of tests/test_web.py).

The tab asks for a stream (`stream: true, partial_images: 2`, OpenAI's images streaming API) and shows previews
as `image_generation.partial_image` events arrive, the final image on `image_generation.completed`; a server
that answers JSON gets the whole answer shown at once. Both paths are checked against a real server on a tiny
Z-Image pipeline; the event parsing also against the documented event stream, served to the page directly.
"""

from __future__ import annotations

import base64
import io
import json
import re

import pytest
from test_web import Page, browser, serving  # noqa: F401 (browser: the module's Chromium fixture)

from minisgl_cli.media.settings import MediaSettings
from minisgl_cli.server.settings import ServerSettings

pytestmark = pytest.mark.slow


def _png(w: int, h: int, color: tuple[int, int, int]) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _fill(page, prompt: str, size: str, steps: int, n: int, seed: int) -> None:
    page.click("#image-tab")
    page.fill("#image-prompt", prompt)
    page.fill("#image-size", size)
    page.fill("#image-steps", str(steps))
    page.fill("#image-n", str(n))
    page.fill("#image-seed", str(seed))


def _sizes(page) -> list[list[int]]:
    page.wait_for_function("() => [...document.querySelectorAll('#images img')].every(im => im.complete)")
    return page.locator("#images img").evaluate_all("ims => ims.map(im => [im.naturalWidth, im.naturalHeight])")


@pytest.fixture(scope="module")
def image_url(tiny_models):
    with serving(ServerSettings(media=MediaSettings(image_model_dir=tiny_models["z-image"]))) as url:
        yield url


def test_image_tab_asks_for_previews_and_shows_every_image(browser, image_url):  # noqa: F811
    """Through the real server, streamed or not: the body asks for 2 previews, the n images all arrive."""
    from playwright.sync_api import expect

    web = Page(browser, image_url).open()
    try:
        page = web.page
        page.evaluate("""() => { window.previews = 0; new MutationObserver(ms => { for (const m of ms)
            if (m.target.classList && m.target.classList.contains('pending') && m.target.src) window.previews++; })
            .observe(document.getElementById('images'), {subtree: true, attributes: true}); }""")
        _fill(page, "a red lantern", "48x32", 3, 2, 5)
        with page.expect_request(lambda r: r.url.endswith("/v1/images/generations")) as req:
            page.click("#image-go")
        body = json.loads(req.value.post_data)
        assert body["stream"] is True and body["partial_images"] == 2 and body["n"] == 2 and body["seed"] == 5
        expect(page.locator("#image-status")).to_contain_text("2 images in")
        assert _sizes(page) == [[48, 32], [48, 32]]
        expect(page.locator("#images img.pending")).to_have_count(0)
        # the server streams: previews were shown before the final images
        assert "(streamed)" in page.inner_text("#image-status") and page.evaluate("window.previews") > 0
    finally:
        web.close()


def test_image_tab_renders_the_documented_event_stream(browser, image_url):  # noqa: F811
    """OpenAI's event shapes, served to the page for this one route: previews first (shown, marked pending), then
    the completed image; the status counts them."""
    from playwright.sync_api import expect

    events = [("image_generation.partial_image", {"b64_json": _png(16, 16, (200, 0, 0)), "partial_image_index": i})
              for i in range(2)]
    events.append(("image_generation.completed", {"b64_json": _png(32, 16, (0, 0, 200)), "size": "32x16"}))
    stream = "".join(f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n" for name, data in events)
    web = Page(browser, image_url).open()
    try:
        page = web.page
        page.route("**/v1/images/generations", lambda route: route.fulfill(
            status=200, headers={"content-type": "text/event-stream"}, body=stream))
        _fill(page, "a blue square", "32x16", 2, 1, 1)
        page.click("#image-go")
        expect(page.locator("#image-status")).to_contain_text("32x16 · 1 image in")
        expect(page.locator("#image-status")).to_contain_text("2 previews (streamed)")
        assert _sizes(page) == [[32, 16]]
        expect(page.locator("#images img.pending")).to_have_count(0)
    finally:
        web.close()


def test_image_tab_shows_a_refusal_in_one_line(browser, image_url):  # noqa: F811
    from playwright.sync_api import expect

    web = Page(browser, image_url).open()
    try:
        _fill(web.page, "x", "50x32", 1, 1, 1)
        web.page.click("#image-go")
        expect(web.page.locator("#image-status")).to_contain_text("error: width must be a multiple of 16")
        expect(web.page.locator("#images img")).to_have_count(0)
    finally:
        web.close()


def test_live_view_shows_the_media_workers_figures_as_the_server_sends_them(browser, image_url):  # noqa: F811
    """/metrics/live's "media" section from the real server, after one image: its queued and running jobs, then the
    jobs ended, the batch sizes and the step time on one line. Without the section (a server with no media
    worker): nothing shown."""
    import httpx
    from playwright.sync_api import expect

    r = httpx.post(f"{image_url}/v1/images/generations", json={"prompt": "a lantern", "size": "32x32", "steps": 2,
                                                               "seed": 0}, timeout=300)
    assert r.status_code == 200, r.text
    web = Page(browser, image_url).open()
    try:
        page = web.page
        expect(page.locator("#conn")).to_have_text("live")
        expect(page.locator("#media-live")).to_be_visible()
        expect(page.locator("#m-media-queued")).to_have_text("0")
        expect(page.locator("#m-media-inflight")).to_have_text("0")
        expect(page.locator("#m-media-extra")).to_have_text(re.compile(
            r"^completed [1-9]\d* · cancelled \d+ · failed \d+ · batch \d\.\d\d \(last [1-9]\) · "
            r"step \d+\.\d ms \(last \d+\.\d\)$"))

        def without_media(route):
            m = route.fetch().json()
            del m["media"]
            route.fulfill(json=m)

        page.route("**/metrics/live", without_media)
        expect(page.locator("#media-live")).to_be_hidden()
        page.unroute_all(behavior="ignoreErrors")  # a poll in flight must not outlive the page
    finally:
        web.close()
