"""OpenAI-style errors: `InputError` (what a handler raises), engine errors mapped to statuses, the app's handlers.

Every non-2xx response of the server carries OpenAI's error body (`protocol.ErrorResponse`); streams that
fail after their first frame carry the same body as their last frame (`error_frame`).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl_cli.client import ENGINE_GONE
from minisgl_cli.server import protocol as p
from minisgl_cli.types import Delta

log = logging.getLogger("minisgl.server")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error"}


class InputError(Exception):
    """A request the engine cannot serve as given: becomes a 4xx with an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.headers = message, param, status, code, headers


class Disconnected(Exception):
    """The client hung up before its response was ready."""


def engine_error(delta: Delta) -> InputError:
    """The error a failed engine request answers with: 503 when the engine died, 500 for engine faults,
    400 for the input's."""
    message = delta.error or "unknown engine error"
    if message.startswith(ENGINE_GONE):
        return InputError(message, status=503, code="engine_unavailable")
    if message.startswith("internal error"):
        return InputError(message, status=500, code="engine_error")
    return InputError(message, code="context_length_exceeded" if "context limit" in message else None)


def error_frame(delta: Delta) -> dict[str, Any]:
    """The error body a stream ends with when its engine request fails after the first frame."""
    e = engine_error(delta)
    return {"error": {"message": e.message, "type": ERROR_TYPES.get(e.status, "server_error"),
                      "param": e.param, "code": e.code}}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts = []
        for e in errors[:3]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return p.error_response(422, f"malformed JSON body: {first.get('msg')}", "invalid_request_error",
                                    None, "json_invalid")
        param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return p.error_response(422, "; ".join(parts) or "invalid request", "invalid_request_error", param,
                                first.get("type"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return p.error_response(exc.status_code, str(exc.detail), ERROR_TYPES.get(exc.status_code, "server_error"),
                                headers=getattr(exc, "headers", None))

    @app.exception_handler(InputError)
    async def input_error(_: Request, exc: InputError) -> JSONResponse:
        kind = ERROR_TYPES.get(exc.status, "server_error")
        return p.error_response(exc.status, exc.message, kind, exc.param, exc.code, exc.headers)

    @app.exception_handler(Disconnected)
    async def disconnected(_: Request, __: Disconnected) -> Response:
        # Nobody reads this; 499 (nginx's "client closed request") keeps the logs honest.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return p.error_response(500, f"internal server error: {type(exc).__name__}", "server_error")
