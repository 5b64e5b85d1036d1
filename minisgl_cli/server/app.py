"""The HTTP app: `create_app(client, settings)` assembles routes, edge checks and errors around one EngineClient.

What lives where: `openai_routes` and `generate_route` (the handlers), `context` (the steps they share),
`runs` (engine streams -> HTTP responses), `deadline` (request deadlines), `gate` (backpressure), `edge` (API key,
body cap, counts), `errors` (OpenAI error bodies), `web` (the page at / and the /metrics/live it polls). Here: the
app itself, /health and /metrics.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import PlainTextResponse

from minisgl_cli.api import protocol as p
from minisgl_cli.client.protocol import EngineClient
from minisgl_cli.server import (
    generate_route,
    messages_route,
    ollama_routes,
    openai_routes,
    responses_route,
    web,
)
from minisgl_cli.server.context import Ctx, ServerContext
from minisgl_cli.server.edge import EdgeMiddleware
from minisgl_cli.server.errors import install_error_handlers
from minisgl_cli.server.media import build_media_router
from minisgl_cli.server.metrics import media_prometheus
from minisgl_cli.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app", "json_metrics", "shutdown_app"]

server_router = APIRouter(tags=["server"])


@server_router.get("/health", response_model=p.Health)
async def health(ctx: Ctx) -> Any:
    if not ctx.client.healthy():
        return p.error_response(503, "the engine's scheduler is not running or has stalled", "server_error")
    return p.Health()


@server_router.get("/metrics", responses={200: {"content": {"text/plain": {}}}})
async def metrics_route(request: Request, ctx: Ctx,
                        format: str | None = Query(None, pattern="^(json|prometheus)$")) -> Any:
    stats = await asyncio.get_running_loop().run_in_executor(None, ctx.client.stats)
    accept = request.headers.get("accept", "")
    prometheus = format == "prometheus" or (
        format is None and "text/plain" in accept and "application/json" not in accept)
    if prometheus:
        return PlainTextResponse(ctx.metrics.to_prometheus(stats, ctx.model_name, ctx.client.info)
                                 + media_prometheus(ctx.media.metrics(), ctx.model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")
    return ctx.metrics_json(stats)


def create_app(client: EngineClient, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    ctx = ServerContext.create(client, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await shutdown_app(app)

    app = FastAPI(title="minisgl", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible LLM server over one minisgl engine.")
    app.state.ctx = ctx
    app.add_middleware(EdgeMiddleware, settings=settings, metrics=ctx.metrics)
    install_error_handlers(app)
    app.include_router(build_media_router(service=ctx.media))
    for router in (server_router, openai_routes.router, messages_route.router, responses_route.router,
                   ollama_routes.router, generate_route.router):
        app.include_router(router)
    if settings.web:
        app.include_router(web.router)
    return app


async def shutdown_app(app: FastAPI) -> None:
    """Abort the app's requests still in flight and stop its media worker (its lifespan's end; a server fronting it
    calls this too)."""
    ctx: ServerContext = app.state.ctx
    await asyncio.get_running_loop().run_in_executor(None, ctx.media.close)  # its open jobs end with a 503
    await ctx.shutdown()


def json_metrics(app: FastAPI) -> dict[str, Any]:
    """The /metrics JSON, from any thread (the ZMQ control channel uses it)."""
    ctx: ServerContext = app.state.ctx
    return ctx.metrics_json(ctx.client.stats())
