"""The web page at `/`: the packaged chat + live engine view (server/web/), and `/metrics/live` that it polls.

The page is plain HTML + JS shipped inside the package: no build step, nothing loaded from elsewhere (its
Content-Security-Policy allows this server only). It talks to the public API like any client: chat through
/v1/chat/completions, images through /v1/images/generations, and the engine's figures through
`GET /metrics/live` (the /metrics JSON, the last requests, and what the page needs to know of the server),
polled once a second while the tab is visible. Polling rather than a held-open stream: an open tab then
never holds up the server's shutdown. `--no-web` leaves all of it out.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse

from minisgl_cli.api import protocol as p
from minisgl_cli.media.settings import MediaSettings
from minisgl_cli.server.context import Ctx, ServerContext

WEB_DIR = Path(__file__).with_name("web")
PAGE_FILES = ("app.js", "style.css")  # served under /web/; index.html is served at /
# Everything from this origin; images arrive as data: URLs from /v1/images/generations.
CSP = "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
_TYPES = {".js": "text/javascript", ".css": "text/css"}

router = APIRouter(tags=["web"])


def is_page_file(path: str) -> bool:
    """The page's own files, which load without the API key (/metrics/live and the API need it)."""
    return path == "/" or path.removeprefix("/web/") in PAGE_FILES


@router.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(WEB_DIR / "index.html", media_type="text/html",
                        headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"})


@router.get("/web/{name}", include_in_schema=False)
async def page_file(name: str) -> Any:
    if name not in PAGE_FILES:
        return p.error_response(404, f"no page file {name!r}", "not_found_error")
    path = WEB_DIR / name
    return FileResponse(path, media_type=_TYPES[path.suffix], headers={"Cache-Control": "no-cache"})


def page_config(ctx: ServerContext) -> dict[str, Any]:
    """What the page shows besides the figures: the model, its limits, and whether there is an image tab."""
    info = ctx.client.info
    media = ctx.settings.media or MediaSettings.from_env()
    return {"model": ctx.model_name, "engine": info.engine, "device": info.device, "dtype": info.dtype,
            "max_context_len": info.max_context_len, "max_running": info.max_running,
            "image_model": media.image_model if media.available("image") else None}


@router.get("/metrics/live")
async def metrics_live(ctx: Ctx) -> dict[str, Any]:
    """The /metrics JSON plus `recent` (the last requests: tokens, TTFT, TPOT) and `page` (page_config)."""
    stats = await asyncio.get_running_loop().run_in_executor(None, ctx.client.stats)
    return {**ctx.metrics_json(stats), "recent": ctx.metrics.recent(), "page": page_config(ctx)}
