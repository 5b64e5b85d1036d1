"""The router's connections to its workers: kept open between requests, taken and given back at O(1) per request.

httpx's own pool (httpcore 1.0) walks every connection it holds on each request and each response's close, and
for each idle one walks them all again: with 256 streams in flight the router spent most of its CPU there, and
most of all at the start of a burst that follows another (every connection of the last one idle). Here each
connection is a one-connection httpx transport (httpx still connects, maps errors and drops a connection past
its keep-alive), kept in a stack per worker: a request takes the one freed last, or opens one.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable

import httpx


class _GiveBack(httpx.AsyncByteStream):
    """A response's body whose close hands its connection back."""

    def __init__(self, stream: httpx.AsyncByteStream, give_back: Callable[[], None]):
        self._stream, self._give_back = stream, give_back

    def __aiter__(self) -> AsyncIterator[bytes]:  # the inner iterator as it is: nothing added per chunk
        return self._stream.__aiter__()

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            give_back, self._give_back = self._give_back, lambda: None
            give_back()


class KeptConnections(httpx.AsyncBaseTransport):
    """As many connections to each host as it had requests in flight at once; one left idle `keepalive_s` is
    closed (under a uvicorn worker's 5 s: a request never meets one the worker has just closed)."""

    def __init__(self, keepalive_s: float):
        self.keepalive_s = keepalive_s
        self._ssl = httpx.create_ssl_context()  # one for all: building one loads the CA bundle
        self._idle: defaultdict[tuple[bytes, bytes, int | None], deque[tuple[float, httpx.AsyncHTTPTransport]]] = \
            defaultdict(deque)  # per host, the connections freed last on the right
        self._busy: set[httpx.AsyncHTTPTransport] = set()

    def _new(self) -> httpx.AsyncHTTPTransport:
        return httpx.AsyncHTTPTransport(verify=self._ssl, limits=httpx.Limits(
            max_connections=1, max_keepalive_connections=1, keepalive_expiry=self.keepalive_s))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        idle = self._idle[(request.url.raw_scheme, request.url.raw_host, request.url.port)]
        now = time.monotonic()
        while idle and now - idle[0][0] > self.keepalive_s:  # the oldest, past their keep-alive
            await idle.popleft()[1].aclose()
        conn = idle.pop()[1] if idle else self._new()
        self._busy.add(conn)
        try:
            resp = await conn.handle_async_request(request)
        except BaseException:
            self._busy.discard(conn)
            await conn.aclose()
            raise

        def give_back() -> None:
            self._busy.discard(conn)
            idle.append((time.monotonic(), conn))

        assert isinstance(resp.stream, httpx.AsyncByteStream)
        resp.stream = _GiveBack(resp.stream, give_back)
        return resp

    async def aclose(self) -> None:
        for conn in [*self._busy, *(c for idle in self._idle.values() for _, c in idle)]:
            await conn.aclose()
        self._busy.clear()
        self._idle.clear()
