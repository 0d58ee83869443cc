"""The OpenAI-compatible HTTP front: the gRPC servicer's sibling, on aiohttp's web server, on the
same event loop, serving the same engine (`EngineSlot`).

    POST /v1/completions, /v1/chat/completions   streaming (SSE) or not
    GET  /v1/models                              the served model, with max_model_len
    GET  /health                                 200 serving, 503 loading, draining or failed
    POST /tokenize, /detokenize                  vLLM's shapes

A body is checked and turned into the same DecodeRequest a gRPC caller sends (openai_request.py),
parsed by the same `Request.parse`, admitted by the same `Engine.submit`; the engine's stream
becomes SSE chunks (openai_response.py). Every failure leaves through one place, `_error`, with the
status and body `shared.errors.to_http_error` assigns to its exception, the field named as the
body named it. A failure after a stream's first chunk is an error frame (`data: {"error": ...}`),
then `data: [DONE]`, as vLLM ends such a stream: never a silent truncation. Each request's end is
told by the same `RequestTelemetry.finish` as a Decode's (the `request_finished` event, the
metrics, its server span, a child of the caller's `traceparent`).

The bearer token (--auth-token-file) guards every route but /health, as vLLM's --api-key does;
TLS uses the gRPC server's certificates. The `X-Request-Id` header names the request (vLLM's), and
`X-Request-Timeout` (seconds) is its deadline, gRPC's deadline on this front: past it, the request
ends DEADLINE_EXCEEDED, 408 (an error frame once streaming). A body over --max-receive-bytes is
413; aiohttp's own refusals (404, 405, 413) answer in the same JSON shape, without a reason.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from engine.v1 import engine_pb2 as pb
from engine_service.config import ServerConfig
from engine_service.generation.controls import FinishReason
from engine_service.generation.logprobs import TokenLogprobs
from engine_service.requests import Request, loggable_request_id, parse_tokenize
from engine_service.runtime.engine import Engine, Handle
from engine_service.transport.engine_slot import EngineSlot, Ready
from engine_service.transport.openai_request import Endpoint, OpenAICall, json_text, parse_body
from engine_service.transport.openai_response import Shaper, Usage
from engine_service.transport.telemetry import RequestOutcome, RequestTelemetry, log_request_text
from shared.errors import (
    ContextLengthExceeded,
    EngineError,
    InternalError,
    InvalidField,
    RequestTooLarge,
    Unauthenticated,
    status_code_of,
    to_http_error,
)
from shared.tracing import extract_context, log_ids

log = structlog.get_logger()

REQUEST_ID_HEADER = "X-Request-Id"
TIMEOUT_HEADER = "X-Request-Timeout"
OPEN_PATHS = frozenset({"/health"})  # served without the bearer token
SHUTDOWN_TIMEOUT_S = 1.0  # streams still open when the server stops (after the drain) are closed after this
DONE = b"data: [DONE]\n\n"
NO_TEMPLATE = ("messages need a model with a chat template, and this engine's model has none; "
               "send a prompt to /v1/completions")


def error_response(err: EngineError, param: str | None = None, request_id: str = "") -> web.Response:
    answer = to_http_error(err, param)
    headers = {**answer.headers, **({REQUEST_ID_HEADER: request_id} if request_id else {})}
    return web.json_response(answer.body, status=answer.status, headers=headers)


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


@web.middleware
async def _aiohttp_refusals(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                            ) -> web.StreamResponse:
    """aiohttp's own refusals (no route, wrong method, body too large) in the front's JSON shape."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = f"{request.method} {request.path}: {exc.reason}" + (f" ({exc.text})" if exc.text else "")
        return web.json_response({"error": {"message": message, "type": type(exc).__name__.removeprefix("HTTP"),
                                            "param": None, "code": exc.status}}, status=exc.status)


class _ServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger, but for bytes that are not an HTTP request (a chunk size of garbage, a
    Content-Length of -5, a header over 8 KiB), which aiohttp answers 400 itself and logs as an error
    with a traceback: the caller's fault, so a warning, `http_request_malformed`. Every other record
    (a handler that raised) goes through as aiohttp logs it."""

    def exception(self, msg: object, *args: object, exc_info: object = True, **kwargs: object) -> None:
        if isinstance(exc_info, HttpProcessingError):
            peer = args[0] if args else ""
            log.warning("http_request_malformed", peer=str(peer), status=exc_info.code,
                        error=" ".join(str(exc_info.message).split())[:200] or type(exc_info).__name__)
            return
        self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)  # type: ignore[arg-type]


@dataclass
class RunningHttp:
    runner: web.AppRunner
    port: int


class HttpFront:
    def __init__(self, slot: EngineSlot, telemetry: RequestTelemetry, cfg: ServerConfig) -> None:
        self.slot = slot
        self.telemetry = telemetry
        self.cfg = cfg
        self._expected = f"Bearer {cfg.auth_token}".encode() if cfg.auth_token else None
        self.serving = False  # what /health says: set with gRPC health (server.set_health)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_receive_bytes, middlewares=[_aiohttp_refusals])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        return app

    async def start(self, host: str, port: int) -> RunningHttp:
        """Bind and serve (port 0: any free one); TLS when the gRPC server has it."""
        runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None,
                               shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                               logger=_ServerLog(logging.getLogger("aiohttp.server")))
        await runner.setup()
        site = web.TCPSite(runner, host, port, ssl_context=self._ssl_context(), reuse_port=False)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return RunningHttp(runner, bound)

    def _ssl_context(self) -> ssl.SSLContext | None:
        cfg = self.cfg
        if cfg.tls_cert is None or cfg.tls_key is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
        if cfg.tls_client_ca is not None:
            context.load_verify_locations(cfg.tls_client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    # -- routes ----------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def health(self, request: web.Request) -> web.Response:
        if self.serving:
            return web.json_response({"status": "ok"})
        match self.slot.state:
            case Ready(engine):
                state = "draining" if engine.draining else "failed"
            case _:
                state = "loading"
        return web.json_response({"status": state}, status=503)

    async def models(self, request: web.Request) -> web.Response:
        refused = self._refusal(request)
        if refused is not None:
            return error_response(refused)
        info = (await self.slot.engine()).info
        return web.json_response({"object": "list", "data": [{
            "id": info.model, "object": "model", "created": 0, "owned_by": "engine_service",
            "root": info.model, "max_model_len": info.max_context_tokens}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's: `{"prompt", "add_special_tokens"}` or `{"messages"}` -> `{"count", "max_model_len",
        "tokens", "token_strs"}` (the pieces when `return_token_strs`)."""
        try:
            self._check_token(request)
            body = await _read_json(request, self.cfg.max_receive_bytes)
            engine = await self.slot.engine()
            loaded = engine.loaded
            msg = pb.TokenizeRequest()
            if isinstance(body.get("messages"), list):
                call = parse_body({"messages": body["messages"]}, "chat", "", engine.info.model)
                if loaded.chat_template is None:  # as /v1/chat/completions says it (not Tokenize's gRPC words)
                    raise InvalidField("messages", f"{len(body['messages'])} messages", NO_TEMPLATE)
                msg.chat.CopyFrom(call.message.chat)
            else:
                msg.text = json_text(body.get("prompt"), "prompt")
            special = body.get("add_special_tokens", True)
            if not isinstance(special, bool):
                raise InvalidField("add_special_tokens", repr(special), f"add_special_tokens must be a boolean, got {special!r}")
            try:
                ids = parse_tokenize(msg, engine.limits, loaded.tokenizer, loaded.chat_template, special)
            except EngineError as err:
                raise _renamed_tokenize(err) from None
            strs = [loaded.tokenizer.piece(i) for i in ids] if body.get("return_token_strs") is True else None
            return web.json_response({"count": len(ids), "max_model_len": engine.info.max_context_tokens,
                                      "tokens": list(ids), "token_strs": strs})
        except EngineError as err:
            return error_response(err)
        except Exception:  # the boundary's contract: a bug answers 500, the traceback in the log
            log.exception("tokenize_internal_error")
            return error_response(InternalError.build("tokenize"))

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's: `{"tokens": [ids]}` -> `{"prompt": text}`."""
        try:
            self._check_token(request)
            body = await _read_json(request, self.cfg.max_receive_bytes)
            engine = await self.slot.engine()
            tokens = body.get("tokens")
            if not isinstance(tokens, list):
                raise InvalidField("tokens", type(tokens).__name__, f"tokens must be an array of token ids, got {tokens!r:.80}")
            vocab = engine.limits.vocab_size
            for i, token in enumerate(tokens):
                if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
                    raise InvalidField(f"tokens[{i}]", repr(token)[:80],
                                       f"tokens[{i}] must be a token id in 0..{vocab - 1}, got {token!r:.80}")
            return web.json_response({"prompt": engine.loaded.tokenizer.decode(tokens)})
        except EngineError as err:
            return error_response(err)
        except Exception:  # the boundary's contract, as tokenize's
            log.exception("detokenize_internal_error")
            return error_response(InternalError.build("detokenize"))

    # -- a generation, start to end ----------------------------------------------------------------
    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        started = time.monotonic()
        span = self.telemetry.start_http_span(request.path, extract_context(
            [(key.lower(), value) for key, value in request.headers.items()]))
        ids = log_ids(span)
        request_id = loggable_request_id(request.headers.get(REQUEST_ID_HEADER, ""))
        call, handle, error, finish, stream = None, None, None, None, None
        gone = False  # the caller's connection closed under a write
        code = grpc.StatusCode.CANCELLED  # unless the request gets further
        try:
            self._check_token(request)
            body = await _read_json(request, self.cfg.max_receive_bytes)
            engine = await self.slot.engine()
            call = parse_body(body, endpoint, _header_text(request, REQUEST_ID_HEADER), engine.info.model)
            parsed = self._parse(call, engine, _deadline(request, started))
            request_id = parsed.request_id
            constraint = await engine.compile(parsed.response_format, parsed.request_id) \
                if parsed.response_format else None
            handle = engine.submit(parsed, trace=ids, constraint=constraint)
            shaper = Shaper(call, request_id, engine.info.model, engine.loaded.tokenizer.piece)
            if call.stream:
                stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                     REQUEST_ID_HEADER: request_id})
                finish = await self._stream(request, stream, handle, call, shaper, engine)
                answer: web.StreamResponse = stream
            else:
                answer, finish = await self._whole(handle, call, shaper, engine)
            code = grpc.StatusCode.OK
        except EngineError as err:
            error = call.rename(err) if call is not None else err
        except asyncio.CancelledError:  # the caller went away (aiohttp cancels the handler): CANCELLED, as over gRPC
            raise
        except ConnectionResetError:
            # it went away before aiohttp saw it, under a write: CANCELLED too. The answer goes back to
            # aiohttp, which ends a dead connection's quietly (re-raised, aiohttp answers 500 and logs an error)
            gone = True
        except Exception:  # the boundary's contract: a bug in one request's handling answers 500
            log.exception("request_internal_error", request_id=request_id, **ids)
            error = InternalError.build(request_id or "unassigned")
        finally:
            if handle is not None:
                self.slot.ready_engine().release(handle)
            if error is not None:
                code = status_code_of(error)
            span.set_attribute("http.response.status_code", error.http_code if error is not None else 200)
            self.telemetry.finish(span, RequestOutcome.of(request_id, code, error, started, handle,
                                                          finish.value if finish is not None else None, self.slot.model))
            if self.cfg.log_text and handle is not None:
                log_request_text(handle, self.slot.ready_engine().loaded.tokenizer, ids)
        if gone:
            return stream if stream is not None else web.Response(status=499, reason="Client Closed Request")
        if error is None:
            return answer
        if stream is not None and stream.prepared:  # the stream has begun: its end says what happened
            try:
                await stream.write(_sse(to_http_error(error).body))
                await stream.write(DONE)
                await stream.write_eof()
            except ConnectionResetError:  # the caller went away meanwhile: there is no one to tell
                pass
            return stream
        return error_response(error, request_id=request_id)

    def _parse(self, call: OpenAICall, engine: Engine, deadline: float | None) -> Request:
        """`Request.parse` of the call's DecodeRequest; without max_tokens, chat gets what the
        context leaves after its prompt (up to --max-new-tokens), as vLLM gives it."""
        loaded, limits, msg = engine.loaded, engine.limits, call.message
        if call.endpoint == "chat" and loaded.chat_template is None:
            raise InvalidField("messages", f"{len(msg.chat.messages)} messages", NO_TEMPLATE)
        if call.max_tokens_default and msg.max_new_tokens == 0:
            msg.max_new_tokens = limits.max_new_tokens_limit
            try:
                return Request.parse(msg, limits, loaded.tokenizer, deadline, loaded.chat_template)
            except ContextLengthExceeded as err:
                prompt = int(err.metadata["promptTokens"])
                if prompt >= limits.max_context_tokens:
                    raise
                msg.max_new_tokens = limits.max_context_tokens - prompt
        return Request.parse(msg, limits, loaded.tokenizer, deadline, loaded.chat_template)

    async def _whole(self, handle: Handle, call: OpenAICall, shaper: Shaper, engine: Engine
                     ) -> tuple[web.Response, FinishReason]:
        texts: list[str] = [_echo(call, handle, engine)]
        logprobs: list[TokenLogprobs] = []
        prompt_logprobs: list[TokenLogprobs] = []
        while True:
            update = await handle.stream.next()
            if update.error is not None:
                raise update.error
            texts.append(update.text)
            logprobs.extend(update.logprobs)
            prompt_logprobs.extend(update.prompt_logprobs)
            if update.finish is not None:
                break
        first = handle.seq.request.prompt_ids[0] if call.echo else None
        body = shaper.whole("".join(texts), update.finish, _stop_reason(handle, update.finish),
                            shaper.logprobs(logprobs, prompt_logprobs, first), _usage(handle))
        return web.json_response(body, headers={REQUEST_ID_HEADER: handle.seq.request_id}), update.finish

    async def _stream(self, request: web.Request, stream: web.StreamResponse, handle: Handle, call: OpenAICall,
                      shaper: Shaper, engine: Engine) -> FinishReason:
        """Chunks as the engine's updates come; the answer begins (its status and headers are sent)
        with the first, so that a failure before any token still gets its own status."""
        echo = _echo(call, handle, engine)
        first = True
        while True:
            update = await handle.stream.next()
            if update.error is not None and not update.tokens:
                raise update.error
            if not (update.text or update.tokens or update.finish is not None or update.prompt_logprobs):
                continue
            if not stream.prepared:
                await stream.prepare(request)
            prompt_first = handle.seq.request.prompt_ids[0] if call.echo and first else None
            logprobs = shaper.logprobs(update.logprobs, update.prompt_logprobs, prompt_first)
            text = (echo if first else "") + update.text
            if call.endpoint == "chat" and first:  # the role first, as OpenAI streams it
                await stream.write(_sse(shaper.chunk("", first=True)))
                first = False
            await stream.write(_sse(shaper.chunk(text, logprobs, update.finish, _stop_reason(handle, update.finish))))
            first = False
            if update.error is not None:  # after the tokens that came with it, as the gRPC front sends them
                raise update.error
            if update.finish is not None:
                if call.include_usage:
                    await stream.write(_sse(shaper.usage_chunk(_usage(handle))))
                await stream.write(DONE)
                await stream.write_eof()
                return update.finish

    # -- credentials ---------------------------------------------------------------------------
    def _refusal(self, request: web.Request) -> Unauthenticated | None:
        if self._expected is None or request.path in OPEN_PATHS:
            return None
        sent = request.headers.get("Authorization", "")
        if hmac.compare_digest(sent.encode("utf-8", "surrogateescape"), self._expected):  # the bytes as sent
            return None
        why = "missing" if not sent else "invalid"
        log.warning("call_unauthenticated", method=request.path, credential=why, peer=request.remote or "")
        return Unauthenticated(f"{why} bearer token for {request.path}",
                               metadata={"scheme": "Bearer", "method": request.path})

    def _check_token(self, request: web.Request) -> None:
        refused = self._refusal(request)
        if refused is not None:
            raise refused


async def _read_json(request: web.Request, limit: int) -> dict:  # type: ignore[type-arg]
    """The body as a JSON object; `limit`: --max-receive-bytes, which aiohttp enforces too (client_max_size)."""
    # a Content-Length past the limit is refused before reading: a caller that announces 10 MB and
    # sends it slowly (or never) gets its 413 now, not once the limit's worth of bytes has come
    if request.content_length is not None and request.content_length > limit:
        raise RequestTooLarge(f"body must be at most {limit} bytes (--max-receive-bytes), got a "
                              f"Content-Length of {request.content_length}")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:  # a chunked body past the limit, read as far as the limit
        raise RequestTooLarge(f"body must be at most {limit} bytes (--max-receive-bytes), got more "
                              f"(a chunked body)") from None
    try:
        body = json.loads(raw)
    except RecursionError:
        raise InvalidField("body", f"{len(raw)} bytes", "body must be JSON nested less deeply, got nesting "
                                                         "deeper than the parser's limit") from None
    except ValueError as err:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        raise InvalidField("body", f"{len(raw)} bytes", f"body must be a JSON object in UTF-8, got {len(raw)} "
                                                         f"bytes that are not ({err})") from None
    if not isinstance(body, dict):
        raise InvalidField("body", type(body).__name__, f"body must be a JSON object, got {json.dumps(body)[:80]}")
    return body


def _header_text(request: web.Request, name: str) -> str:
    """A header's value ("" when absent) as UTF-8 text. aiohttp reads header bytes that are not
    UTF-8 as lone surrogates (surrogateescape), which no protobuf string field takes."""
    value = request.headers.get(name, "")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidField(name, ascii(value[:80]), f"{name} must be UTF-8 text, got the bytes "
                                                    f"{value.encode('utf-8', 'surrogateescape')[:80]!r}, which are "
                                                    f"not (at byte {err.start})") from None
    return value


def _renamed_tokenize(err: EngineError) -> EngineError:
    """Tokenize's `text` is this route's `prompt`, its `chat.messages` the body's `messages`."""
    names = {"text": "prompt", "chat.messages": "messages", "chat": "messages"}
    if err.field in names:
        err.field = names[err.field]
        err.metadata["field"] = err.field
        err.message = err.message.replace("chat.messages", "messages").replace("text ", "prompt ", 1) \
            if err.message.startswith(("text", "chat.messages")) else err.message
        err.args = (err.message,)
    return err


def _deadline(request: web.Request, started: float) -> float | None:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidField(TIMEOUT_HEADER, raw[:80], f"{TIMEOUT_HEADER} must be a number of seconds > 0, got {raw[:80]!r}")
    return started + seconds


def _echo(call: OpenAICall, handle: Handle, engine: Engine) -> str:
    """The prompt's text, for a completion with echo (the text as sent, or the ids' decoded)."""
    if not call.echo:
        return ""
    msg = call.message
    if msg.WhichOneof("prompt") == "prompt_text":
        return msg.prompt_text
    return engine.loaded.tokenizer.decode(list(handle.seq.request.prompt_ids))


def _stop_reason(handle: Handle, finish: FinishReason | None) -> str | int | None:
    """vLLM's stop_reason: the stop string matched, or the stop token produced (None for EOS and length)."""
    if finish is not FinishReason.STOP:
        return None
    seq = handle.seq
    text = seq.controls.text
    if text is not None and text.stop_string is not None:
        return text.stop_string
    if seq.generated and seq.generated[-1] in seq.request.stop_token_ids:
        return seq.generated[-1]
    return None


def _usage(handle: Handle) -> Usage:
    seq = handle.seq
    return Usage(len(seq.request.prompt_ids), len(seq.generated), seq.cached_tokens)
