"""Edge middleware: the API key, the body-size cap and per-route status counts, before any route runs.

Pure ASGI, so streamed responses pass through untouched.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minisgl_cli.server.errors import error_response
from minisgl_cli.server.metrics import ServerMetrics
from minisgl_cli.server.settings import ServerSettings
from minisgl_cli.server.web import is_page_file

# Counted by name in /metrics; any other path counts as "other".
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
          "/api/chat", "/api/generate", "/v1/images/generations", "/v1/videos", "/v1/models", "/generate", "/metrics",
          "/metrics/live", "/health")


class EdgeMiddleware:
    """Pure ASGI (streams pass through untouched): API key, body-size cap, per-route status counts."""

    def __init__(self, app: ASGIApp, settings: ServerSettings, metrics: ServerMetrics):
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in ROUTES else "other"

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.request(endpoint, message["status"])
            await send(message)

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = self.settings.api_key
        # /health and the page's own files need no key (the page holds no secret; it asks for the key).
        if key and path != "/health" and not (self.settings.web and is_page_file(path)):
            # Bearer (OpenAI's clients) or x-api-key (Anthropic's header).
            bearer, api_key = headers.get("authorization"), headers.get("x-api-key")
            given, want = (api_key, key) if api_key is not None and bearer is None else (bearer or "", f"Bearer {key}")
            if not hmac.compare_digest(given.encode(), want.encode()):
                resp = error_response(path, 401, "invalid or missing API key: send 'Authorization: Bearer <key>' "
                                      "or 'x-api-key: <key>'", "authentication_error", None, "invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, counted_send)
                return
        limit = self.settings.max_body_bytes
        too_large = error_response(path, 413, f"request body is larger than the limit of {limit} bytes",
                                   "invalid_request_error", None, "request_too_large")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            await too_large(scope, receive, counted_send)
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            # Read the body here (at most limit + 1 bytes) so a chunked upload cannot exceed the cap.
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    await too_large(scope, receive, counted_send)
                    return
                chunks.append(chunk)
                more = message.get("more_body", False)
            body, replayed = b"".join(chunks), False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()  # later reads only ever see the disconnect

            await self.app(scope, replay, counted_send)
            return
        await self.app(scope, receive, counted_send)
