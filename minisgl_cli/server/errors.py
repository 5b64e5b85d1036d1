"""Errors: engine errors mapped to statuses, the app's handlers (`InputError`, what a handler raises, is declared
with the wire format in protocol.py and re-exported here), each API's error body.

Every non-2xx response of the server carries its API's error body (`error_response`: OpenAI's
`protocol.ErrorResponse`, Anthropic's under /v1/messages, ollama's under /api/); streams that fail after their
first frame carry the same body as their last frame (`error_frame`).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl_cli.admission import AdmissionError, grammar_field
from minisgl_cli.api import anthropic
from minisgl_cli.api import protocol as p
from minisgl_cli.api.protocol import InputError
from minisgl_cli.types import Delta, ErrorCode, SamplingParams

__all__ = ["InputError", "Disconnected", "coded_error", "engine_error", "error_frame", "error_response",
           "install_error_handlers", "refused"]

log = logging.getLogger("minisgl.server")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 503: "server_error", 504: "server_error"}


# Every ErrorCode's HTTP status and OpenAI `code` (None: the type alone says it).
CODE_TABLE: dict[ErrorCode, tuple[int, str | None]] = {
    ErrorCode.INVALID_REQUEST: (400, None),
    ErrorCode.CONTEXT_LENGTH: (400, "context_length_exceeded"),
    ErrorCode.UNSUPPORTED: (400, "unsupported_feature"),
    ErrorCode.ENGINE_FAILED: (500, "engine_error"),
    ErrorCode.OVERLOADED: (429, "too_many_requests"),
    ErrorCode.UNAVAILABLE: (503, "engine_unavailable"),
    ErrorCode.CANCELLED: (503, "engine_unavailable"),
    ErrorCode.TIMEOUT: (504, "request_timeout"),
}
# The codes whose answer says when to try again: the engine is busy (429), or gone for now (503: a restart, or with
# a router in front another worker).
RETRY_LATER = frozenset({ErrorCode.OVERLOADED, ErrorCode.UNAVAILABLE, ErrorCode.CANCELLED})


def admission_error(exc: AdmissionError) -> InputError:
    status, code = CODE_TABLE[exc.code]
    return InputError(exc.message, exc.param, status, code)


class Disconnected(Exception):
    """The client hung up before its response was ready."""


def engine_error(delta: Delta, retry_after_s: int = 1, params: SamplingParams | None = None) -> InputError:
    """The error a failed engine request answers with, by its code (CODE_TABLE): 503 (+ Retry-After) when the
    engine is gone (with --dp: every replica), 504 past the request's deadline, 500 for engine faults, 429 (+
    Retry-After) when every --dp replica is at its cap, 400 for the input's, naming the field the delta names
    (admission's), else the grammar's (`params`: the scheduler refuses a grammar that does not compile). A delta
    without a code is an engine fault."""
    code = delta.error_code or ErrorCode.ENGINE_FAILED
    status, name = CODE_TABLE[code]
    headers = {"Retry-After": str(retry_after_s)} if code in RETRY_LATER else None
    param = delta.error_param
    if param is None and params is not None and code is ErrorCode.INVALID_REQUEST:
        param = grammar_field(params)
    return InputError(delta.error or "unknown engine error", param, status, name, headers)


def coded_error(exc: Exception, retry_after_s: int = 1) -> InputError | None:
    """The error of an exception that says what failed (its `code`: the engine gone, every replica busy, the
    deadline passed), as engine_error answers it; None for one that does not (the caller says whose fault it is)."""
    code = getattr(exc, "code", None)
    if not isinstance(code, ErrorCode):
        return None
    return engine_error(Delta("", error=str(exc) or type(exc).__name__, error_code=code), retry_after_s)


def refused(delta: Delta) -> bool:
    """Whether the delta ends a request its client refused at admission (it never ran): the error names a field."""
    return delta.error_param is not None


def error_frame(delta: Delta) -> dict[str, Any]:
    """The error body a stream ends with when its engine request fails after the first frame."""
    e = engine_error(delta)
    return {"error": {"message": e.message, "type": ERROR_TYPES.get(e.status, "server_error"),
                      "param": e.param, "code": e.code}}


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_response(path: str, status: int, message: str, type: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """The error body of the API `path` belongs to: Anthropic's under /v1/messages, ollama's under /api/, else
    OpenAI's."""
    if path.startswith("/api/"):
        return JSONResponse({"error": message}, status_code=status, headers=headers)
    if is_anthropic(path):
        return JSONResponse(anthropic.error_body(status, message), status_code=status, headers=headers)
    return p.error_response(status, message, type, param, code, headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # 400 as OpenAI answers any invalid request (FastAPI's default would be 422).
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(request.url.path, 400, f"malformed JSON body: {first.get('msg')}",
                                  "invalid_request_error", None, "json_invalid")
        parts = [_describe(e) for e in errors[:3]]
        return error_response(request.url.path, 400, "; ".join(parts) or "invalid request",
                              "invalid_request_error", _param(first), first.get("type"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(request.url.path, exc.status_code, str(exc.detail),
                              ERROR_TYPES.get(exc.status_code, "server_error"), headers=getattr(exc, "headers", None))

    @app.exception_handler(InputError)
    async def input_error(request: Request, exc: InputError) -> JSONResponse:
        kind = ERROR_TYPES.get(exc.status, "server_error")
        return error_response(request.url.path, exc.status, exc.message, kind, exc.param, exc.code, exc.headers)

    @app.exception_handler(Disconnected)
    async def disconnected(_: Request, __: Disconnected) -> Response:
        # Nobody reads this; 499 (nginx's "client closed request") keeps the logs honest.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(request.url.path, 500, f"internal server error: {type(exc).__name__}", "server_error")


def _loc(e: dict[str, Any]) -> str:
    """The field path of a validation error (messages.0.content), without pydantic's union-branch names."""
    parts = [str(x) for x in e.get("loc", ()) if x != "body"]
    return ".".join(x for x in parts if not (x[:1].isupper() or "[" in x or x in _BRANCHES))


# Names pydantic puts in an error's path for the branch of a union it tried (a message's role, a type).
_BRANCHES = {"str", "int", "float", "bool", "list", "dict", "system", "developer", "user", "assistant", "tool"}


def _param(e: dict[str, Any]) -> str | None:
    """The field a validation error is about: its path, or the field a model-level check named first."""
    loc = _loc(e)
    head = str(e.get("msg", "")).removeprefix("Value error, ").partition(":")[0]
    if head.replace("_", "").isalnum() and head.islower():
        return f"{loc}.{head}" if loc else head
    return loc or None


def _describe(e: dict[str, Any]) -> str:
    loc, msg = _loc(e), str(e.get("msg", ""))
    if e.get("type") == "extra_forbidden":
        return f"unknown field {loc!r}: this API has no such field (docs/server.md lists what minisgl implements)"
    msg = msg.removeprefix("Value error, ")
    if loc and msg.startswith(loc.rpartition(".")[2] + ":"):  # the validator already named the field
        return f"{loc.rpartition('.')[0] + '.' if '.' in loc else ''}{msg}"
    return f"{loc}: {msg}" if loc else msg
