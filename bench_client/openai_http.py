"""The OpenAI-compatible HTTP adapter: with its connection pool (openai_pool.py) and its server-info
probe (openai_server_info.py), the only modules of the client that speak HTTP.

It serves the `ServerClient` protocol of `bench_client.server_api` for one base URL of
llama-server, vLLM, SGLang, TGI or this engine's own HTTP front (--http-port). What it sends:

- `decode` of a DecodeSpec: POST /v1/completions with `"prompt"` the spec's token ids (a list of
  ints: llama-server, vLLM, SGLang) or its text (a string: every server, TGI included, whose
  completions take strings only), or POST /v1/chat/completions with its `messages` (the server
  renders its chat template); both with the same sampling fields (`completion_body`, `chat_body`):
  max_tokens, temperature, top_p, top_k where > 0, seed, ignore_eos where set, `stream` and
  `stream_options.include_usage`; the spec's request_id as the `X-Request-Id` header (vLLM's, which
  this engine's HTTP front takes as the request's id, as engine.v1 takes `request_id`: its logs
  name a request alike over both fronts). `chat` (the preview) sends its ChatSpec through
  `chat_body` too;
- `tokenize`: POST /tokenize with one body that each server reads its own field of (`content`:
  llama-server, which adds no BOS by default; `prompt` with `add_special_tokens: false`: vLLM;
  `inputs`: TGI, which adds its tokenizer's special tokens: those with an empty span are dropped);
- GET /health, and GET /props, /v1/models, /info, /version for what the server says about itself.

Every failure becomes the domain exception that `bench_client.openai_errors` chooses, so the policy
table decides as it does for gRPC.

A streamed answer becomes Chunks as bench_client/openai_stream.py reads its events (a stream that
ends without [DONE] and without finish_reason just ends: the point runner counts it); the bodies and
the server's small answers are built and read by bench_client/openai_json.py.

The connections, and the resend of a request that went out on a dead pooled connection:
bench_client/openai_pool.py; the target's base URL, TLS and headers: bench_client/openai_target.py;
health and what the server says about itself: bench_client/openai_server_info.py.

The bearer token goes on every request, health included. Each streamed request runs in a CLIENT
span (a child of the current one, the point's) whose W3C traceparent travels in the request's
headers; a resend is on the same span (`http.request.resend_count`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from opentelemetry import propagate, trace
from opentelemetry.trace import Status, StatusCode
from opentelemetry.util.types import AttributeValue

from bench_client import openai_server_info
from bench_client.credentials import ChannelSecurity
from bench_client.openai_errors import (
    NOT_SERVED,
    client_timeout,
    from_http_response,
    malformed_event,
    transport_failure,
)
from bench_client.openai_json import chat_body, completion_body, token_ids_from, tokenize_body
from bench_client.openai_pool import ConnectionPool
from bench_client.openai_stream import StreamReader
from bench_client.openai_target import HttpTarget
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
from shared.errors import EngineError, status_code_of

tracer = trace.get_tracer("bench_client")

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
TOKENIZE = "/tokenize"
REQUEST_ID_HEADER = "X-Request-Id"


class OpenAIClient:
    """One connection pool to one OpenAI-compatible server (`target`: "http://host:port" or
    "https://...", a bare "host:port" meaning http, or https when `security` has TLS; a trailing
    "/v1" is dropped). `vocab_size` and `model` stand in for what the server does not report."""

    def __init__(self, target: str, security: ChannelSecurity | None = None, *, concurrency: int = 64,
                 vocab_size: int | None = None, model: str | None = None) -> None:
        self._target = HttpTarget.of(target, security or ChannelSecurity())
        self.base_url = self._target.base_url
        self.target = self.base_url
        self._pool = ConnectionPool(self._target, concurrency)
        self._vocab_size = vocab_size
        self._model = model  # the model named in each request: the constructor's, else the server's

    @property
    def stale_connection_resends(self) -> int:
        """Requests sent again after a dead pooled connection (bench_client/openai_pool.py)."""
        return self._pool.stale_connection_resends

    def set_concurrency(self, concurrency: int) -> None:
        """Size the connection pool for the next point (ConnectionPool.set_concurrency)."""
        self._pool.set_concurrency(concurrency)

    async def close(self) -> None:
        await self._pool.close()

    # -- health and what the server says about itself -----------------------------------------

    async def is_serving(self, timeout: float = 2.0) -> bool:
        """GET /health answers 200 (llama-server answers 503 while it loads the model)."""
        return await openai_server_info.is_serving(self._pool, self._target, timeout)

    async def wait_until_serving(self, timeout: float, poll_s: float = 0.2) -> bool:
        """Poll /health until it answers 200 or `timeout` seconds passed; returns whether it did."""
        return await poll_until_serving(self.is_serving, timeout, poll_s)

    async def server_info(self, timeout: float = 10.0) -> ServerInfo:
        """What the server reports (bench_client/openai_server_info.py). `vocab_size` is the server's
        (llama-server's `meta.n_vocab`), else the constructor's, else 0 (not reported: vLLM, SGLang
        and TGI do not say); the model it names is the requests' from now on, unless the
        constructor named one."""
        info = await openai_server_info.server_info(self._pool, self._target, timeout, model=self._model,
                                                    vocab_size=self._vocab_size)
        if self._model is None and info.model:
            self._model = info.model
        return info

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
            return self._stream(CHAT_COMPLETIONS, chat_body(spec, self._model), timeout, chat=True,
                                request_id=spec.request_id, attributes={
                                    "gen_ai.operation.name": "chat", **span_attributes, **(attributes or {})})
        return self._stream(COMPLETIONS, completion_body(spec, self._model), timeout, chat=False,
                            request_id=spec.request_id, attributes={
                                "gen_ai.operation.name": "text_completion", **span_attributes, **(attributes or {})})

    def chat(self, spec: ChatSpec, *, timeout: float) -> DecodeStream:
        """Stream the answer to chat messages (POST /v1/chat/completions: the server renders its
        chat template), as `decode` streams."""
        return self._stream(CHAT_COMPLETIONS, chat_body(spec, self._model), timeout, chat=True,
                            request_id=spec.request_id, attributes={
                                "gen_ai.operation.name": "chat", "gen_ai.request.max_tokens": spec.max_new_tokens,
                                "bench.request.id": spec.request_id})

    async def tokenize(self, text: str, timeout: float = 10.0) -> list[int]:
        """The ids the server's tokenizer gives `text` alone, without the special tokens it would
        add to a prompt (POST /tokenize, `tokenize_body`; the answer read by `token_ids_from`).
        Raises NoTokenizeEndpoint, naming the URL, where the server has no such route (404, 405,
        501); another failure raises its EngineError."""
        url = self.base_url + TOKENIZE
        with self._pool.session() as session:
            try:
                response = await self._pool.post(session, url, tokenize_body(text, self._model), {}, timeout)
                async with response:
                    payload = await response.read()
                    if response.status in NOT_SERVED:
                        raise NoTokenizeEndpoint(f"{url} answered HTTP {response.status}: the server has no "
                                                 "tokenize endpoint")
                    if response.status != 200:
                        raise from_http_response(response.status, response.headers, payload)
            except TimeoutError as exc:
                raise client_timeout(url, timeout) from exc
            except (aiohttp.ClientError, OSError) as exc:
                raise transport_failure(url, exc) from exc
        return token_ids_from(payload, url)

    def _stream(self, route: str, body: Mapping[str, Any], timeout: float, *, chat: bool, request_id: str,
                attributes: Mapping[str, AttributeValue]) -> DecodeStream:
        stream = DecodeStream()
        stream._chunks = self._chunks(route, body, timeout, chat, request_id, attributes, stream)
        return stream

    async def _chunks(self, route: str, body: Mapping[str, Any], timeout: float, chat: bool, request_id: str,
                      attributes: Mapping[str, AttributeValue], stream: DecodeStream) -> AsyncIterator[Chunk]:
        url = self.base_url + route
        # Not made current: an async generator may be finished in another context than it started in.
        span = tracer.start_span(f"POST {route}", kind=trace.SpanKind.CLIENT)
        headers: dict[str, str] = {REQUEST_ID_HEADER: request_id}
        if span.is_recording():
            split = urlsplit(url)
            span.set_attributes({"http.request.method": "POST", "url.full": url,
                                 "server.address": split.hostname or "", "server.port": split.port or 0,
                                 **attributes})
            propagate.inject(headers, context=trace.set_span_in_context(span))
        reader = StreamReader(chat)
        events = 0
        try:
            with self._pool.session() as session:
                try:
                    response = await self._pool.post(session, url, body, headers, timeout, span)
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
                    raise client_timeout(url, timeout) from exc
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
            span.set_attribute("gen_ai.usage.output_tokens", reader.output_tokens)
            if reader.usage_input_tokens is not None:
                span.set_attribute("gen_ai.usage.input_tokens", reader.usage_input_tokens)
            if reader.cached_tokens is not None:
                span.set_attribute("gen_ai.usage.cache_read.input_tokens", reader.cached_tokens)
            span.end()


def _failed(span: trace.Span, err: EngineError) -> None:
    span.set_attribute("error.type", err.reason or type(err).__name__)
    span.add_event("http_error", {"error.code": status_code_of(err).name, "error.reason": err.reason,
                                  "error.message": err.message})
    span.set_status(Status(StatusCode.ERROR, f"{type(err).__name__}: {err.message}"))
