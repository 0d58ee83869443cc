"""The OpenAI-compatible HTTP adapter: the only module of the client that speaks HTTP.

It serves the `ServerClient` protocol of `bench_client.server_api` for one base URL of
llama-server, vLLM, SGLang or TGI. What it sends:

- `decode` of a DecodeSpec: POST /v1/completions with `"prompt"` the spec's token ids (a list of
  ints: llama-server, vLLM, SGLang) or its text (a string: every server, TGI included, whose
  completions take strings only), or POST /v1/chat/completions with its `messages` (the server
  renders its chat template); both with the same sampling fields (`completion_body`, `chat_body`):
  max_tokens, temperature, top_p, top_k where > 0, seed, ignore_eos where set, `stream` and
  `stream_options.include_usage`. `chat` (the preview) sends its ChatSpec through `chat_body` too;
- `tokenize`: POST /tokenize with one body that each server reads its own field of (`content`:
  llama-server, which adds no BOS by default; `prompt` with `add_special_tokens: false`: vLLM;
  `inputs`: TGI, which adds its tokenizer's special tokens: those with an empty span are dropped);
- GET /health, and GET /props, /v1/models, /info, /version for what the server says about itself.

Every failure becomes the domain exception that `bench_client.openai_errors` chooses, so the policy
table decides as it does for gRPC.

A streamed answer becomes Chunks as bench_client/openai_stream.py reads its events (a stream that
ends without [DONE] and without finish_reason just ends: the point runner counts it); the bodies and
the server's small answers are built and read by bench_client/openai_json.py.

The connections: one aiohttp.ClientSession, its pool sized by `concurrency` (`set_concurrency`
grows it for the next point: a pool smaller than the point's concurrency would queue requests in
the client and inflate TTFT). An idle pooled connection is reused for KEEPALIVE_TIMEOUT_S at most,
less than the servers keep one open (cpp-httplib, llama-server's HTTP library, and uvicorn, vLLM's
and SGLang's, close an idle keep-alive connection after 5 s, silently). A POST that went out on a
reused pooled connection which turns out to be dead before any answer came (the server had closed
it: aiohttp's ClientOSError, "Connection reset by peer" or "Can not write request body", or
ServerDisconnectedError, before the status line) is sent once more, on a fresh connection, without
raising: the connection was the client's business, the request was never the server's, so no retry
is counted and the policy is not asked. `stale_connection_resends` counts those resends (and a
`stale_connection_resent` debug event names each). A failure to connect, a timeout, an HTTP error
status, a failure on a fresh connection and a failed resend raise as any failure does.

The bearer token goes on every request, health included. Each streamed request runs in a CLIENT
span (a child of the current one, the point's) whose W3C traceparent travels in the request's
headers; a resend is on the same span (`http.request.resend_count`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import structlog
from opentelemetry import propagate, trace
from opentelemetry.trace import Status, StatusCode
from opentelemetry.util.types import AttributeValue

from bench_client.credentials import ChannelSecurity, TlsConfig
from bench_client.openai_errors import (
    from_http_response,
    malformed_event,
    transport_failure,
)
from bench_client.openai_json import chat_body, completion_body, server_info_from, token_ids_from, tokenize_body
from bench_client.openai_stream import StreamReader
from bench_client.server_api import (
    ChatSpec,
    Chunk,
    DecodeSpec,
    DecodeStream,
    NoTokenizeEndpoint,
    ServerInfo,
    poll_until_serving,
)
from bench_client.sse import SSEParser
from shared.errors import ClientTimeout, EngineError, EngineUnavailable, QueueFull, status_code_of

tracer = trace.get_tracer("bench_client")
log = structlog.get_logger()

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
TOKENIZE = "/tokenize"
# How long an idle pooled connection may be reused: under the 5 s after which cpp-httplib
# (llama-server: CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND) and uvicorn (vLLM, SGLang: timeout_keep_alive)
# close it, with room for a busy client loop that notices a response's end late.
KEEPALIVE_TIMEOUT_S = 3.0
# What aiohttp raises for a dead pooled connection before any status line: ClientOSError (ECONNRESET
# on reading, "Can not write request body" when the transport closed under the body),
# ServerDisconnectedError (EOF before the status line), ClientConnectionResetError (the headers met a
# closing transport). ClientConnectorError, a ClientOSError too, is a failure to connect: never stale.
_STALE = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionResetError)
_INFO_ROUTES = {"props": "/props", "models": "/v1/models", "info": "/info", "version": "/version"}
_NOT_SERVED = frozenset({404, 405, 501})  # a route this server does not have


class OpenAIClient:
    """One aiohttp session to one OpenAI-compatible server (`target`: "http://host:port" or
    "https://...", a bare "host:port" meaning http, or https when `security` has TLS; a trailing
    "/v1" is dropped). `vocab_size` and `model` stand in for what the server does not report."""

    def __init__(self, target: str, security: ChannelSecurity | None = None, *, concurrency: int = 64,
                 vocab_size: int | None = None, model: str | None = None) -> None:
        security = security or ChannelSecurity()
        self.base_url = base_url(target, tls=security.tls is not None)
        self.target = self.base_url
        self._ssl: ssl.SSLContext | bool = True
        self._server_hostname: str | None = None
        if self.base_url.startswith("https://"):
            if security.tls is not None:
                self._ssl = ssl_context(security.tls)
                self._server_hostname = security.tls.server_name
        self._headers: dict[str, str] = {"Accept": "text/event-stream, application/json"}
        if security.token:
            self._headers["Authorization"] = f"Bearer {security.token}"
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self._limit = concurrency
        self._vocab_size = vocab_size
        self._model = model  # the model named in each request: the constructor's, else the server's
        self._pool: _Pool | None = None
        self._retired: set[_Pool] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self._fresh: aiohttp.ClientSession | None = None  # for resends: a new connection each request
        self._closed = False
        self.stale_connection_resends = 0  # requests sent again after a dead pooled connection

    # -- the session ---------------------------------------------------------------------------

    def set_concurrency(self, concurrency: int) -> None:
        """Size the connection pool for the next point: a larger pool replaces the session for new
        requests (the old one closes once its requests end); a smaller one keeps the pool as it is."""
        if concurrency <= self._limit:
            return
        self._limit = concurrency
        if self._pool is not None:
            self._retire(self._pool)
            self._pool = None

    def _session(self) -> _Pool:
        if self._closed:
            raise RuntimeError(f"the client of {self.base_url} is closed")
        if self._pool is None:
            connector = aiohttp.TCPConnector(limit=self._limit, limit_per_host=0, keepalive_timeout=KEEPALIVE_TIMEOUT_S)
            reuse = aiohttp.TraceConfig()
            reuse.on_connection_reuseconn.append(_mark_reused)
            self._pool = _Pool(aiohttp.ClientSession(connector=connector, headers=self._headers, trace_configs=[reuse]))
        return self._pool

    def _fresh_session(self) -> aiohttp.ClientSession:
        """The session of resends: each request on a new connection, closed after it."""
        if self._fresh is None:
            self._fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0),
                                                headers=self._headers)
        return self._fresh

    @contextlib.contextmanager
    def _using(self) -> Iterator[_Pool]:
        """The session for one request, kept open until the request ends."""
        pool = self._session()
        pool.active += 1
        try:
            yield pool
        finally:
            self._release(pool)

    def _retire(self, pool: _Pool) -> None:
        pool.retired = True
        self._retired.add(pool)  # close() closes it, if nothing did before
        if pool.active == 0:
            self._release(pool, ended=False)

    def _release(self, pool: _Pool, *, ended: bool = True) -> None:
        """One request of `pool` ended; a replaced session closes its idle connections once its last
        request ended (llama-server gives each open connection one of its HTTP threads)."""
        pool.active -= int(ended)
        if not (pool.retired and pool.active == 0 and pool in self._retired):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # outside the loop: close() does it
        self._retired.discard(pool)
        task = loop.create_task(pool.session.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        self._closed = True
        pools = [p for p in (self._pool, *self._retired) if p is not None]
        self._pool, self._retired = None, set()
        for pool in pools:
            await pool.session.close()
        if self._fresh is not None:
            await self._fresh.close()
            self._fresh = None
        if self._closing:
            await asyncio.gather(*self._closing)

    def _request_options(self, timeout: float) -> dict[str, Any]:
        options: dict[str, Any] = {"timeout": aiohttp.ClientTimeout(total=timeout), "ssl": self._ssl}
        if self._server_hostname:
            options["server_hostname"] = self._server_hostname
        return options

    # -- health and what the server says about itself -----------------------------------------

    async def is_serving(self, timeout: float = 2.0) -> bool:
        """GET /health answers 200 (llama-server answers 503 while it loads the model); False on any
        other status and on any connection failure or timeout."""
        with self._using() as pool:
            try:
                async with pool.session.get(self.base_url + "/health", **self._request_options(timeout)) as response:
                    await response.read()
                    return response.status == 200
            except (TimeoutError, aiohttp.ClientError, OSError):
                return False

    async def wait_until_serving(self, timeout: float, poll_s: float = 0.2) -> bool:
        """Poll /health until it answers 200 or `timeout` seconds passed; returns whether it did."""
        return await poll_until_serving(self.is_serving, timeout, poll_s)

    async def server_info(self, timeout: float = 10.0) -> ServerInfo:
        """What the server reports: llama-server's /props and /v1/models (`meta.n_vocab`), vLLM's
        and SGLang's /v1/models (`max_model_len`) and /version, TGI's /info. A route the server does
        not have is passed over; another failure raises its EngineError (a 503 while the model
        loads: EngineUnavailable, so that the sweep waits for health). `vocab_size` is the server's
        (llama-server's `meta.n_vocab`), else the constructor's, else 0 (not reported: vLLM, SGLang
        and TGI do not say)."""
        names = list(_INFO_ROUTES)
        answers = await asyncio.gather(*(self._get_json(_INFO_ROUTES[n], timeout) for n in names))
        reported = {name: body for name, body in zip(names, answers, strict=True) if body is not None}
        if "props" not in reported and "models" not in reported and "info" not in reported:
            raise _not_an_openai_server(self.base_url)
        info = server_info_from(reported, model=self._model, vocab_size=self._vocab_size)
        if self._model is None and info.model:
            self._model = info.model
        return info

    async def _get_json(self, route: str, timeout: float) -> Any:
        url = self.base_url + route
        with self._using() as pool:
            try:
                async with pool.session.get(url, **self._request_options(timeout)) as response:
                    body = await response.read()
                    if response.status in _NOT_SERVED:
                        return None
                    if response.status != 200:
                        err = from_http_response(response.status, response.headers, body)
                        if isinstance(err, QueueFull) and response.status == 503:
                            raise _loading(err, url) from None
                        raise err
            except TimeoutError as exc:
                raise _timeout(url, timeout) from exc
            except (aiohttp.ClientError, OSError) as exc:
                raise transport_failure(url, exc) from exc
        try:
            return json.loads(body)
        except ValueError:
            return None  # a page that is not this API's (a proxy's, a UI's)

    # -- the calls -----------------------------------------------------------------------------

    def decode(self, spec: DecodeSpec, *, timeout: float,
               attributes: Mapping[str, AttributeValue] | None = None) -> DecodeStream:
        """Stream one answer to `spec` inside its CLIENT span: its token ids or text completed (POST
        /v1/completions), its messages answered (POST /v1/chat/completions); a failed call raises
        its EngineError."""
        span_attributes: dict[str, AttributeValue] = {"gen_ai.request.max_tokens": spec.max_new_tokens,
                                                      "bench.request.id": spec.request_id}
        if spec.prompt_token_ids:
            span_attributes["gen_ai.usage.input_tokens"] = len(spec.prompt_token_ids)
        if spec.messages:
            return self._stream(CHAT_COMPLETIONS, chat_body(spec, self._model), timeout, chat=True, attributes={
                "gen_ai.operation.name": "chat", **span_attributes, **(attributes or {})})
        return self._stream(COMPLETIONS, completion_body(spec, self._model), timeout, chat=False, attributes={
            "gen_ai.operation.name": "text_completion", **span_attributes, **(attributes or {})})

    def chat(self, spec: ChatSpec, *, timeout: float) -> DecodeStream:
        """Stream the answer to chat messages (POST /v1/chat/completions: the server renders its
        chat template), as `decode` streams."""
        return self._stream(CHAT_COMPLETIONS, chat_body(spec, self._model), timeout, chat=True, attributes={
            "gen_ai.operation.name": "chat", "gen_ai.request.max_tokens": spec.max_new_tokens,
            "bench.request.id": spec.request_id})

    async def tokenize(self, text: str, timeout: float = 10.0) -> list[int]:
        """The ids the server's tokenizer gives `text` alone, without the special tokens it would
        add to a prompt (POST /tokenize, `tokenize_body`; the answer read by `token_ids_from`).
        Raises NoTokenizeEndpoint, naming the URL, where the server has no such route (404, 405,
        501); another failure raises its EngineError."""
        url = self.base_url + TOKENIZE
        with self._using() as pool:
            try:
                response = await self._post(pool, url, tokenize_body(text, self._model), {}, timeout)
                async with response:
                    payload = await response.read()
                    if response.status in _NOT_SERVED:
                        raise NoTokenizeEndpoint(f"{url} answered HTTP {response.status}: the server has no "
                                                 "tokenize endpoint")
                    if response.status != 200:
                        raise from_http_response(response.status, response.headers, payload)
            except TimeoutError as exc:
                raise _timeout(url, timeout) from exc
            except (aiohttp.ClientError, OSError) as exc:
                raise transport_failure(url, exc) from exc
        return token_ids_from(payload, url)

    def _stream(self, route: str, body: Mapping[str, Any], timeout: float, *, chat: bool,
                attributes: Mapping[str, AttributeValue]) -> DecodeStream:
        stream = DecodeStream()
        stream._chunks = self._chunks(route, body, timeout, chat, attributes, stream)
        return stream

    async def _post(self, pool: _Pool, url: str, body: Mapping[str, Any], headers: Mapping[str, str],
                    timeout: float, span: trace.Span | None = None) -> aiohttp.ClientResponse:
        """The response to POST `body` (its status line and headers read). A request that went out
        on a reused pooled connection that turns out dead before any status line arrived (_STALE)
        is sent once more, on a fresh connection, within what is left of `timeout`; whatever that
        raises, and any other failure, is raised."""
        started = time.monotonic()
        attempt = _Attempt()
        try:
            return await pool.session.post(url, json=body, headers=headers, trace_request_ctx=attempt,
                                           **self._request_options(timeout))
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
        return await self._fresh_session().post(url, json=body, headers=headers, **self._request_options(left))

    async def _chunks(self, route: str, body: Mapping[str, Any], timeout: float, chat: bool,
                      attributes: Mapping[str, AttributeValue], stream: DecodeStream) -> AsyncIterator[Chunk]:
        url = self.base_url + route
        # Not made current: an async generator may be finished in another context than it started in.
        span = tracer.start_span(f"POST {route}", kind=trace.SpanKind.CLIENT)
        headers: dict[str, str] = {}
        if span.is_recording():
            split = urlsplit(url)
            span.set_attributes({"http.request.method": "POST", "url.full": url,
                                 "server.address": split.hostname or "", "server.port": split.port or 0,
                                 **attributes})
            propagate.inject(headers, context=trace.set_span_in_context(span))
        pool = self._session()
        pool.active += 1
        reader = StreamReader(chat)
        events = 0
        try:
            try:
                response = await self._post(pool, url, body, headers, timeout, span)
                async with response:
                    stream.replica = self.base_url
                    span.set_attribute("http.response.status_code", response.status)
                    if response.status != 200:
                        raise from_http_response(response.status, response.headers, await response.read())
                    content_type = response.headers.get("Content-Type", "")
                    if not content_type.startswith("text/event-stream"):
                        start = (await response.content.read(200)).decode("utf-8", "replace")
                        raise malformed_event(start, f"a 200 answer of Content-Type {content_type!r}, "
                                                     "not text/event-stream")
                    parser = SSEParser()
                    async for data in response.content.iter_any():
                        received_at = time.perf_counter()
                        for event in parser.feed(data):
                            events += 1
                            for chunk in reader.on_event(event, received_at):
                                yield chunk
                            if reader.done:
                                break
                        if reader.done:
                            break
                    if not reader.done:
                        rest = parser.close()  # the body ended inside an event: read it as one
                        if rest is not None:
                            for chunk in reader.on_event(rest, time.perf_counter()):
                                yield chunk
                    for chunk in reader.end():
                        yield chunk
            except TimeoutError as exc:
                raise _timeout(url, timeout) from exc
            except (aiohttp.ClientError, OSError) as exc:
                during = f"after {events} events of the answer" if events else "before the answer"
                raise transport_failure(url, exc, during=during) from exc
        except EngineError as err:
            _failed(span, err)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            span.set_attribute("error.type", "cancelled")  # the point ended while this call was in flight
            raise
        finally:
            self._release(pool)
            span.set_attribute("gen_ai.usage.output_tokens", reader.output_tokens)
            if reader.usage_input_tokens is not None:
                span.set_attribute("gen_ai.usage.input_tokens", reader.usage_input_tokens)
            if reader.cached_tokens is not None:
                span.set_attribute("gen_ai.usage.cache_read.input_tokens", reader.cached_tokens)
            span.end()


@dataclass(eq=False)
class _Pool:
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


def base_url(target: str, *, tls: bool) -> str:
    """The base URL of `target`; raises ValueError for a scheme that contradicts the TLS settings."""
    target = target.strip().rstrip("/")
    if "://" not in target:
        target = ("https://" if tls else "http://") + target
    split = urlsplit(target)
    if split.scheme not in ("http", "https") or not split.hostname:
        raise ValueError(f"target must be an http:// or https:// URL (or host:port), got {target!r}")
    if tls and split.scheme == "http":
        raise ValueError(f"target {target!r} is plain http:// but the TLS settings (tls) ask for TLS: "
                         "use an https:// target or drop the tls settings")
    return target.removesuffix("/v1")


def ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """A client SSLContext: the CA of `tls` (else the system's roots) and its client certificate."""
    context = ssl.create_default_context(cadata=tls.ca_pem.decode() if tls.ca_pem else None)
    if tls.cert_pem or tls.key_pem:
        if not (tls.cert_pem and tls.key_pem):
            raise ValueError("tls: a client certificate needs both cert_file and key_file")
        with tempfile.TemporaryDirectory() as folder:  # load_cert_chain reads files only
            cert, key = Path(folder, "cert.pem"), Path(folder, "key.pem")
            cert.write_bytes(tls.cert_pem)
            key.touch(mode=0o600)
            key.write_bytes(tls.key_pem)
            context.load_cert_chain(cert, key)
    return context


def _failed(span: trace.Span, err: EngineError) -> None:
    span.set_attribute("error.type", err.reason or type(err).__name__)
    span.add_event("http_error", {"error.code": status_code_of(err).name, "error.reason": err.reason,
                                  "error.message": err.message})
    span.set_status(Status(StatusCode.ERROR, f"{type(err).__name__}: {err.message}"))


def _timeout(url: str, timeout: float) -> ClientTimeout:
    return ClientTimeout(f"{url}: no complete answer within the client's timeout of {timeout:g} s",
                         metadata={"url": url, "timeoutSeconds": f"{timeout:g}"})


def _loading(err: EngineError, url: str) -> EngineUnavailable:
    """A 503 before any point (llama-server loading its model): wait for health, as for a server down."""
    down = EngineUnavailable(f"{url}: {err.message}", metadata=err.metadata, retry_delay=err.retry_delay)
    down.http_status = err.http_status
    return down


def _not_an_openai_server(url: str) -> EngineError:
    err = from_http_response(404, {}, f"{url} serves none of /props, /v1/models, /info: not an OpenAI-compatible "
                                      "server (or not this API)")
    return err
