"""The HTTP adapter's connections to one server: one aiohttp.ClientSession, its pool sized by
`concurrency` (`set_concurrency` grows it for the next point: a pool smaller than the point's
concurrency would queue requests in the client and inflate TTFT). An idle pooled connection is
reused for KEEPALIVE_TIMEOUT_S at most, less than the servers keep one open (cpp-httplib,
llama-server's HTTP library, and uvicorn, vLLM's and SGLang's, close an idle keep-alive connection
after 5 s, silently).

A POST that went out on a reused pooled connection which turns out to be dead before any answer
came (the server had closed it: aiohttp's ClientOSError, "Connection reset by peer" or "Can not
write request body", or ServerDisconnectedError, before the status line) is sent once more, on a
fresh connection, without raising: the connection was the client's business, the request was never
the server's, so no retry is counted and the policy is not asked. `stale_connection_resends` counts
those resends (and a `stale_connection_resent` debug event names each). A failure to connect, a
timeout, an HTTP error status, a failure on a fresh connection and a failed resend raise as any
failure does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp
import structlog
from opentelemetry import trace

from bench_client.openai_target import HttpTarget

log = structlog.get_logger()

# How long an idle pooled connection may be reused: under the 5 s after which cpp-httplib
# (llama-server: CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND) and uvicorn (vLLM, SGLang: timeout_keep_alive)
# close it, with room for a busy client loop that notices a response's end late.
KEEPALIVE_TIMEOUT_S = 3.0
# What aiohttp raises for a dead pooled connection before any status line: ClientOSError (ECONNRESET
# on reading, "Can not write request body" when the transport closed under the body),
# ServerDisconnectedError (EOF before the status line), ClientConnectionResetError (the headers met a
# closing transport). ClientConnectorError, a ClientOSError too, is a failure to connect: never stale.
_STALE = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionResetError)


class ConnectionPool:
    """The pooled session of one target (replaced by a larger one when the concurrency grows), and
    the session of resends, which opens a new connection for each request."""

    def __init__(self, target: HttpTarget, concurrency: int) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self._target = target
        self._limit = concurrency
        self._current: _Session | None = None
        self._retired: set[_Session] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self._fresh: aiohttp.ClientSession | None = None
        self._closed = False
        self.stale_connection_resends = 0  # requests sent again after a dead pooled connection

    @property
    def active(self) -> int:
        """The requests in flight on the current pooled session (0 before it is opened)."""
        return self._current.active if self._current is not None else 0

    def set_concurrency(self, concurrency: int) -> None:
        """Size the pool for the next point: a larger pool replaces the session for new requests
        (the old one closes once its requests end); a smaller one keeps the pool as it is."""
        if concurrency <= self._limit:
            return
        self._limit = concurrency
        if self._current is not None:
            self._retire(self._current)
            self._current = None

    @contextlib.contextmanager
    def session(self) -> Iterator[aiohttp.ClientSession]:
        """The pooled session for one request, kept open until the request ends."""
        pooled = self._pooled()
        pooled.active += 1
        try:
            yield pooled.session
        finally:
            self._release(pooled)

    async def post(self, session: aiohttp.ClientSession, url: str, body: Mapping[str, Any],
                   headers: Mapping[str, str], timeout: float, span: trace.Span | None = None) -> aiohttp.ClientResponse:
        """The response to POST `body` on `session` (its status line and headers read). A request
        that went out on a reused pooled connection that turns out dead before any status line
        arrived (_STALE) is sent once more, on a fresh connection, within what is left of `timeout`;
        whatever that raises, and any other failure, is raised."""
        started = time.monotonic()
        attempt = _Attempt()
        try:
            return await session.post(url, json=body, headers=headers, trace_request_ctx=attempt,
                                      **self._target.request_options(timeout))
        except _STALE as exc:
            if not attempt.reused or isinstance(exc, aiohttp.ClientConnectorError):
                raise
            failure = f"{type(exc).__name__}: {exc}"
        left = timeout - (time.monotonic() - started)
        if left <= 0:
            raise TimeoutError
        self.stale_connection_resends += 1
        log.debug("stale_connection_resent", url=url, error=failure)
        if span is not None:
            span.set_attribute("http.request.resend_count", 1)
            span.add_event("stale_connection_resent", {"error.message": failure})
        return await self._fresh_session().post(url, json=body, headers=headers,
                                                **self._target.request_options(left))

    async def close(self) -> None:
        self._closed = True
        pooled = [p for p in (self._current, *self._retired) if p is not None]
        self._current, self._retired = None, set()
        for p in pooled:
            await p.session.close()
        if self._fresh is not None:
            await self._fresh.close()
            self._fresh = None
        if self._closing:
            await asyncio.gather(*self._closing)

    def _pooled(self) -> _Session:
        if self._closed:
            raise RuntimeError(f"the client of {self._target.base_url} is closed")
        if self._current is None:
            connector = aiohttp.TCPConnector(limit=self._limit, limit_per_host=0, keepalive_timeout=KEEPALIVE_TIMEOUT_S)
            reuse = aiohttp.TraceConfig()
            reuse.on_connection_reuseconn.append(_mark_reused)
            self._current = _Session(aiohttp.ClientSession(connector=connector, headers=self._target.headers,
                                                           trace_configs=[reuse]))
        return self._current

    def _fresh_session(self) -> aiohttp.ClientSession:
        """The session of resends: each request on a new connection, closed after it."""
        if self._fresh is None:
            self._fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0),
                                                headers=self._target.headers)
        return self._fresh

    def _retire(self, pooled: _Session) -> None:
        pooled.retired = True
        self._retired.add(pooled)  # close() closes it, if nothing did before
        if pooled.active == 0:
            self._release(pooled, ended=False)

    def _release(self, pooled: _Session, *, ended: bool = True) -> None:
        """One request of `pooled` ended; a replaced session closes its idle connections once its
        last request ended (llama-server gives each open connection one of its HTTP threads)."""
        pooled.active -= int(ended)
        if not (pooled.retired and pooled.active == 0 and pooled in self._retired):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # outside the loop: close() does it
        self._retired.discard(pooled)
        task = loop.create_task(pooled.session.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


@dataclass(eq=False)
class _Session:
    """A pooled session and the requests in flight on it."""

    session: aiohttp.ClientSession
    active: int = 0
    retired: bool = False


@dataclass(eq=False)
class _Attempt:
    """One request's trace context: whether aiohttp gave it a pooled connection."""

    reused: bool = False


async def _mark_reused(session: aiohttp.ClientSession, context: SimpleNamespace,
                       params: aiohttp.TraceConnectionReuseconnParams) -> None:
    if isinstance(context.trace_request_ctx, _Attempt):
        context.trace_request_ctx.reused = True
