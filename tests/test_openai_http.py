"""The OpenAI-compatible HTTP adapter against small fake servers (aiohttp.web on 127.0.0.1, real
sockets, real status codes), shaped as llama-server, vLLM, SGLang and TGI answer."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from structlog.testing import LogCapture

from bench_client import openai_http, openai_json, openai_pool
from bench_client.credentials import ChannelSecurity, TlsConfig
from bench_client.openai_http import OpenAIClient
from bench_client.server_api import ChatSpec, ChatTurn, Chunk, DecodeSpec, NoTokenizeEndpoint
from bench_client.server_process import free_port
from shared.errors import (
    BadRequest,
    ClientTimeout,
    ContextLengthExceeded,
    EngineError,
    EngineUnavailable,
    QueueFull,
    StreamError,
    TransportError,
    Unauthenticated,
    status_code_of,
)
from tests.certs import make_certs

pytestmark = pytest.mark.timeout(20)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SPEC = DecodeSpec(request_id="r1", prompt_token_ids=(1, 2, 3), max_new_tokens=4, ignore_eos=True,
                  temperature=0.0, top_p=1.0, top_k=0, seed=7)
TIMINGS = {"cache_n": 1, "prompt_n": 2, "prompt_ms": 12.5, "prompt_per_token_ms": 6.25, "prompt_per_second": 160.0,
           "predicted_n": 4, "predicted_ms": 40.0, "predicted_per_token_ms": 13.3, "predicted_per_second": 75.0}


def token(text: str) -> dict[str, Any]:
    """A llama-server /v1/completions partial event (one token)."""
    return {"choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": None}], "created": 1,
            "model": "m", "system_fingerprint": "b1-abc", "object": "text_completion", "id": "cmpl-1"}


def llama_final(finish: str = "length", completion_tokens: int = 4) -> dict[str, Any]:
    """llama-server's last event of a streamed /v1/completions: no text, finish_reason, usage, timings."""
    return {"choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": finish}], "created": 1,
            "model": "m", "system_fingerprint": "b1-abc", "object": "text_completion",
            "usage": {"completion_tokens": completion_tokens, "prompt_tokens": 3, "total_tokens": 3 + completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": 1}},
            "id": "cmpl-1", "timings": {**TIMINGS, "predicted_n": completion_tokens}}


Step = dict[str, Any] | str | bytes | float


def sse(steps: Sequence[Step], *, record: list[dict[str, Any]] | None = None, cut: bool = False) -> Handler:
    """A streaming handler: a dict or str is one `data:` event, bytes go raw, a float sleeps; `cut`
    closes the connection after the steps (no end of the chunked body)."""
    async def handler(request: web.Request) -> web.StreamResponse:
        if record is not None:
            record.append({"json": await request.json(), "headers": dict(request.headers)})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for step in steps:
            if isinstance(step, float):
                await asyncio.sleep(step)
            elif isinstance(step, bytes):
                await response.write(step)
            else:
                await response.write(f"data: {step if isinstance(step, str) else json.dumps(step)}\n\n".encode())
        if cut:
            assert request.transport is not None
            request.transport.close()
            return response
        await response.write_eof()
        return response
    return handler


def answer(status: int, body: Any, headers: dict[str, str] | None = None) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        text = body if isinstance(body, str) else json.dumps(body)
        return web.Response(status=status, text=text, headers=headers,
                            content_type="text/plain" if isinstance(body, str) else "application/json")
    return handler


Serve = Callable[..., Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []

    async def start(routes: dict[str, Handler], tls: ssl.SSLContext | None = None) -> str:
        app = web.Application()
        for key, handler in routes.items():
            method, path = key.split(" ", 1)
            app.router.add_route(method, path, handler)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"{'https' if tls else 'http'}://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def clients() -> AsyncIterator[list[OpenAIClient]]:
    made: list[OpenAIClient] = []
    yield made
    for client in made:
        await client.close()


@pytest.fixture
def client_for(clients: list[OpenAIClient]) -> Callable[..., OpenAIClient]:
    def make(url: str, **kwargs: Any) -> OpenAIClient:
        client = OpenAIClient(url, **kwargs)
        clients.append(client)
        return client
    return make


async def collect(stream: AsyncIterator[Chunk] | Any) -> list[Chunk]:
    return [chunk async for chunk in stream]


async def collect_until_error(stream: Any) -> tuple[list[Chunk], EngineError]:
    chunks: list[Chunk] = []
    with pytest.raises(EngineError) as caught:  # the caller checks the class
        async for chunk in stream:
            chunks.append(chunk)
    return chunks, caught.value


# -- streams ---------------------------------------------------------------------------------------

async def test_a_llama_server_stream(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    url = await serve({"POST /v1/completions": sse([token("a"), 0.03, token("b"), 0.03, token("c"), 0.03,
                                                    token("d"), llama_final(), "[DONE]"])})
    client = client_for(url)
    stream = client.decode(SPEC, timeout=5)
    chunks = await collect(stream)
    assert stream.replica == url
    assert [c.text for c in chunks] == ["a", "b", "c", "d", ""]
    assert [c.num_tokens for c in chunks] == [1, 1, 1, 1, 0]
    gaps = [b.received_at - a.received_at for a, b in zip(chunks[:4], chunks[1:4], strict=False)]
    assert all(gap >= 0.02 for gap in gaps), gaps  # each token when its bytes arrived
    last = chunks[-1]
    assert last.finish_reason == "LENGTH" and all(c.finish_reason is None for c in chunks[:-1])
    assert (last.prompt_tokens, last.completion_tokens, last.cached_prompt_tokens) == (3, 4, 1)
    assert last.server_timings == {k: float(v) for k, v in TIMINGS.items()}
    assert last.timing is None


async def test_finish_and_usage_in_separate_events(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    # vLLM / SGLang: the finish_reason comes with the last token, the usage in an event of its own
    last_token = {"choices": [{"index": 0, "text": "d", "logprobs": None, "finish_reason": "stop",
                               "stop_reason": None}], "usage": None}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    url = await serve({"POST /v1/completions": sse([token("a"), token("b"), token("c"), last_token, usage,
                                                    "[DONE]"])})
    chunks = await collect(client_for(url).decode(SPEC, timeout=5))
    assert [c.text for c in chunks] == ["a", "b", "c", "d"]
    assert [c.num_tokens for c in chunks] == [1, 1, 1, 1]
    last = chunks[-1]
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == ("EOS", 3, 4)
    assert last.cached_prompt_tokens is None and last.server_timings is None


async def test_a_stop_string_is_stop(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    last_token = {"choices": [{"index": 0, "text": "", "finish_reason": "stop", "stop_reason": "###"}]}
    url = await serve({"POST /v1/completions": sse([token("a"), last_token, "[DONE]"])})
    chunks = await collect(client_for(url).decode(SPEC, timeout=5))
    assert chunks[-1].finish_reason == "STOP"


async def test_done_ends_the_stream_even_if_the_connection_stays_open(
        serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    url = await serve({"POST /v1/completions": sse([token("a"), llama_final(completion_tokens=1), "[DONE]",
                                                    "not json, never read", 3.0])})
    started = time.perf_counter()
    chunks = await collect(client_for(url).decode(SPEC, timeout=10))
    assert time.perf_counter() - started < 2.0
    assert [c.finish_reason for c in chunks] == [None, "LENGTH"]


async def test_a_consumer_that_stops_early(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    url = await serve({"POST /v1/completions": sse([token("a"), 3.0, token("b")])})
    client = client_for(url)
    chunks = aiter(client.decode(SPEC, timeout=10))
    started = time.perf_counter()
    first = await anext(chunks)
    await chunks.aclose()  # type: ignore[attr-defined]  # a skipped point stops reading: the connection is freed
    assert first.text == "a" and time.perf_counter() - started < 2.0
    assert client._pool is not None and client._pool.active == 0


async def test_tgi_empty_finish_reason_while_it_goes_on(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    def chunk(text: str, finish: str) -> dict[str, Any]:
        return {"object": "text_completion", "choices": [{"index": 0, "text": text, "logprobs": None,
                                                          "finish_reason": finish}]}
    url = await serve({"POST /v1/completions": sse([chunk("a", ""), chunk("b", ""), chunk("c", "eos_token"),
                                                    "[DONE]"])})
    chunks = await collect(client_for(url).decode(SPEC, timeout=5))
    assert [(c.text, c.num_tokens, c.finish_reason) for c in chunks] == [("a", 1, None), ("b", 1, None),
                                                                          ("c", 1, "EOS")]


async def test_pings_between_events(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    steps: list[Step] = [b":\n\n", token("a"), b": ping\r\n\r\n", token("b"), b":\n\n",
                         llama_final(completion_tokens=2), b":\n\n", "[DONE]"]
    url = await serve({"POST /v1/completions": sse(steps)})
    chunks = await collect(client_for(url).decode(SPEC, timeout=5))
    assert [c.text for c in chunks] == ["a", "b", ""]
    assert chunks[-1].completion_tokens == 2


async def test_a_truncated_answer_reports_length_and_the_counts(
        serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    # the slot's context filled: llama-server stops early with finish_reason "length" and no error
    url = await serve({"POST /v1/completions": sse([token("a"), token("b"), llama_final("length", 2), "[DONE]"])})
    chunks = await collect(client_for(url).decode(
        DecodeSpec("r", (1, 2), 10, True, 0.0, 1.0, 0, 1), timeout=5))
    assert sum(c.num_tokens for c in chunks) == 2
    assert chunks[-1].finish_reason == "LENGTH" and chunks[-1].completion_tokens == 2


async def test_the_request_sent(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    record: list[dict[str, Any]] = []
    url = await serve({"POST /v1/completions": sse([llama_final(completion_tokens=0), "[DONE]"], record=record)})
    client = client_for(url, security=ChannelSecurity(token="s3cret"), model="my-model")
    await collect(client.decode(DecodeSpec("r", (5, 6, 7), 16, True, 0.5, 0.9, 20, 42), timeout=5))
    [sent] = record
    assert sent["headers"]["Authorization"] == "Bearer s3cret"
    assert sent["json"] == {"model": "my-model", "prompt": [5, 6, 7], "max_tokens": 16, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0.5, "top_p": 0.9, "seed": 42,
                            "top_k": 20, "ignore_eos": True}
    await collect(client.decode(SPEC, timeout=5))
    assert "top_k" not in record[1]["json"] and record[1]["json"]["ignore_eos"] is True


async def test_chat(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    record: list[dict[str, Any]] = []

    def delta(content: str | None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": {"content": content, **extra}, "finish_reason": finish}],
                "object": "chat.completion.chunk"}
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11},
             "timings": TIMINGS}
    url = await serve({"POST /v1/chat/completions": sse(
        [delta(None, role="assistant"), delta("Hel"), delta("lo"), delta(None, "stop"), usage, "[DONE]"],
        record=record)})
    client = client_for(url)
    chunks = await collect(client.chat(ChatSpec("c", (ChatTurn("user", "hi"),), 8, 0.0, 3), timeout=5))
    assert [(c.text, c.num_tokens) for c in chunks] == [("Hel", 1), ("lo", 1), ("", 0)]
    assert chunks[-1].finish_reason == "EOS" and chunks[-1].completion_tokens == 2
    assert chunks[-1].cached_prompt_tokens == 1  # from timings.cache_n
    assert record[0]["json"]["messages"] == [{"role": "user", "content": "hi"}]
    assert record[0]["json"]["stream_options"] == {"include_usage": True}


async def test_the_span_and_traceparent(serve: Serve, client_for: Callable[..., OpenAIClient],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(openai_http, "tracer", provider.get_tracer("bench_client"))
    record: list[dict[str, Any]] = []
    url = await serve({"POST /v1/completions": sse([token("a"), llama_final(completion_tokens=1), "[DONE]"],
                                                   record=record)})
    await collect(client_for(url).decode(SPEC, timeout=5, attributes={"bench.point": "p"}))
    [span] = exporter.get_finished_spans()
    assert span.name == "POST /v1/completions"
    assert span.attributes is not None
    assert span.attributes["http.response.status_code"] == 200 and span.attributes["url.full"] == url + "/v1/completions"
    assert span.attributes["gen_ai.usage.output_tokens"] == 1 and span.attributes["gen_ai.usage.input_tokens"] == 3
    assert span.attributes["bench.point"] == "p"
    trace_id = f"{span.context.trace_id:032x}"
    assert record[0]["headers"]["traceparent"].split("-")[1] == trace_id


# -- failures --------------------------------------------------------------------------------------

VLLM_CONTEXT = {"error": {"message": "This model's maximum context length is 2048 tokens. However, you requested "
                                     "2100 tokens (2000 in the messages, 100 in the completion). Please reduce the "
                                     "length of the messages or completion.",
                          "type": "BadRequestError", "param": None, "code": 400}}
SGLANG_CONTEXT = {"object": "error", "message": "The input (3000 tokens) is longer than the model's context length "
                                                "(2048 tokens).", "type": "BadRequestError", "code": 400}
TGI_CONTEXT = {"error": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 2048. Given: 2000 "
                        "`inputs` tokens and 100 `max_new_tokens`", "error_type": "validation"}


@pytest.mark.parametrize(("status", "body", "message"), [
    (400, VLLM_CONTEXT, VLLM_CONTEXT["error"]["message"]),
    (400, SGLANG_CONTEXT, SGLANG_CONTEXT["message"]),
    (422, TGI_CONTEXT, TGI_CONTEXT["error"]),
], ids=["vllm", "sglang", "tgi"])
async def test_context_refusals(serve: Serve, client_for: Callable[..., OpenAIClient], status: int, body: Any,
                                message: str) -> None:
    url = await serve({"POST /v1/completions": answer(status, body)})
    stream = client_for(url).decode(SPEC, timeout=5)
    chunks, err = await collect_until_error(stream)
    assert chunks == [] and type(err) is ContextLengthExceeded
    assert err.message == message and err.http_status == status
    assert stream.replica == url


async def test_a_bad_parameter(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    body = {"error": {"message": "top_k must be -1 (disable), or at least 1, got 0.", "type": "BadRequestError",
                      "code": 400}}
    url = await serve({"POST /v1/completions": answer(400, body)})
    _, err = await collect_until_error(client_for(url).decode(SPEC, timeout=5))
    assert type(err) is BadRequest and err.message == body["error"]["message"]


async def test_429_retry_after(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    url = await serve({"POST /v1/completions": answer(429, {"error": "Model is overloaded", "error_type": "overloaded"},
                                                      {"Retry-After": "2"})})
    _, err = await collect_until_error(client_for(url).decode(SPEC, timeout=5))
    assert type(err) is QueueFull and err.retry_delay == 2.0 and err.http_status == 429


async def test_503_while_loading(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    loading = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    url = await serve({"POST /v1/completions": answer(503, loading), "GET /props": answer(503, loading),
                       "GET /v1/models": answer(503, loading), "GET /health": answer(503, loading)})
    client = client_for(url, vocab_size=100)
    _, err = await collect_until_error(client.decode(SPEC, timeout=5))
    assert type(err) is QueueFull and err.message == "Loading model" and err.retry_delay is None
    assert not await client.is_serving()
    with pytest.raises(EngineUnavailable, match="Loading model") as caught:  # the sweep waits for health
        await client.server_info()
    assert caught.value.http_status == 503


async def test_an_error_frame_after_three_tokens(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    frame = {"error": {"code": 500, "message": "Failed to decode the batch", "type": "server_error"}}
    url = await serve({"POST /v1/completions": sse([token("a"), token("b"), token("c"), frame])})  # no [DONE]
    chunks, err = await collect_until_error(client_for(url).decode(SPEC, timeout=5))
    assert [c.text for c in chunks] == ["a", "b", "c"]
    assert type(err) is StreamError and err.message == "Failed to decode the batch" and err.http_status == 500


async def test_a_malformed_event(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    url = await serve({"POST /v1/completions": sse([token("a"), "{not json", "[DONE]"])})
    chunks, err = await collect_until_error(client_for(url).decode(SPEC, timeout=5))
    assert len(chunks) == 1
    assert type(err) is StreamError and err.http_status == 200 and "{not json" in err.message


async def test_a_stream_that_ends_without_finish(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    url = await serve({"POST /v1/completions": sse([token("a"), token("b")])})  # ends cleanly, no [DONE]
    chunks = await collect(client_for(url).decode(SPEC, timeout=5))
    assert [c.finish_reason for c in chunks] == [None, None]


async def test_a_stream_that_ends_inside_an_error_event(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    url = await serve({"POST /v1/completions": sse([token("a"), b'data: {"error": {"message": "oom", "code": 500}}'])})
    chunks, err = await collect_until_error(client_for(url).decode(SPEC, timeout=5))
    assert len(chunks) == 1 and type(err) is StreamError and err.message == "oom"


async def test_the_connection_closed_mid_stream(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    url = await serve({"POST /v1/completions": sse([token("a"), token("b"), 0.05], cut=True)})
    chunks, err = await collect_until_error(client_for(url).decode(SPEC, timeout=5))
    assert [c.text for c in chunks] == ["a", "b"]
    assert type(err) is EngineUnavailable and url in err.message and "after 2 events" in err.message


async def test_connection_refused(client_for: Callable[..., OpenAIClient]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    client = client_for(url, vocab_size=10)
    stream = client.decode(SPEC, timeout=5)
    _, err = await collect_until_error(stream)
    assert type(err) is EngineUnavailable and url in err.message and "refused" in err.message.lower()
    assert stream.replica is None and client.stale_connection_resends == 0  # a failure to connect: not stale
    assert not await client.is_serving()
    with pytest.raises(EngineUnavailable):
        await client.server_info()


async def test_the_client_timeout(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    url = await serve({"POST /v1/completions": sse([token("a"), 2.0, token("b")])})
    started = time.perf_counter()
    chunks, err = await collect_until_error(client_for(url).decode(SPEC, timeout=0.3))
    assert time.perf_counter() - started < 1.5
    assert len(chunks) == 1 and type(err) is ClientTimeout and "0.3 s" in err.message


async def test_never_healthy(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    url = await serve({"GET /health": answer(503, {"error": {"code": 503, "message": "Loading model",
                                                             "type": "unavailable_error"}})})
    client = client_for(url)
    started = time.monotonic()
    assert await client.wait_until_serving(0.4, poll_s=0.05) is False
    assert 0.35 <= time.monotonic() - started < 1.5


async def test_healthy(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    url = await serve({"GET /health": answer(200, {"status": "ok"})})
    assert await client_for(url).wait_until_serving(1.0)


# -- server_info ---------------------------------------------------------------------------------

LLAMA_PROPS = {"default_generation_settings": {"params": {"top_k": 40}, "n_ctx": 1024}, "total_slots": 4,
               "model_alias": "smollm2", "model_ftype": "Q4_1", "model_path": "/models/smollm2-q4_1.gguf",
               "chat_template": "{% for m in messages %}...", "bos_token": "<s>", "eos_token": "</s>",
               "build_info": "b6000-abcdef", "is_sleeping": False}
LLAMA_MODELS = {"models": [{"name": "smollm2"}], "object": "list", "data": [{
    "id": "smollm2", "object": "model", "owned_by": "llamacpp",
    "meta": {"vocab_type": 2, "n_vocab": 49152, "n_ctx": 1024, "n_ctx_train": 8192, "n_embd": 576}}]}
VLLM_MODELS = {"object": "list", "data": [{"id": "Qwen/Qwen2.5-0.5B", "object": "model", "owned_by": "vllm",
                                           "root": "Qwen/Qwen2.5-0.5B", "max_model_len": 2048}]}


async def test_server_info_of_llama_server(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    record: list[dict[str, Any]] = []
    url = await serve({"GET /props": answer(200, LLAMA_PROPS), "GET /v1/models": answer(200, LLAMA_MODELS),
                       "POST /v1/completions": sse([llama_final(completion_tokens=0), "[DONE]"], record=record)})
    client = client_for(url + "/v1/")
    info = await client.server_info()
    assert (info.api, info.model, info.max_context_tokens, info.vocab_size) == ("openai", "smollm2", 1024, 49152)
    assert (info.max_batch_size, info.engine_version, info.dtype) == (4, "b6000-abcdef", "Q4_1")
    assert (info.eos_token_id, info.bos_token_id, info.has_chat_template) == (-1, -1, True)
    assert set(info.reported) == {"props", "models"} and info.reported["props"] == LLAMA_PROPS
    await collect(client.decode(SPEC, timeout=5))
    assert record[0]["json"]["model"] == "smollm2"  # the server's name, once it said it


async def test_server_info_of_vllm(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    url = await serve({"GET /v1/models": answer(200, VLLM_MODELS), "GET /version": answer(200, {"version": "0.9.1"})})
    info = await client_for(url, vocab_size=151936).server_info()
    assert (info.model, info.max_context_tokens, info.vocab_size) == ("Qwen/Qwen2.5-0.5B", 2048, 151936)
    assert info.engine_version == "0.9.1" and info.max_batch_size == 0
    assert set(info.reported) == {"models", "version"}
    assert (await client_for(url).server_info()).vocab_size == 0  # not reported, none given: 0, no error


async def test_server_info_of_tgi(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    tgi = {"model_id": "bigscience/bloom-560m", "max_input_tokens": 1024, "max_total_tokens": 2048,
           "version": "3.0.1"}
    url = await serve({"GET /info": answer(200, tgi)})
    info = await client_for(url, vocab_size=250880).server_info()
    assert (info.model, info.max_context_tokens, info.engine_version) == ("bigscience/bloom-560m", 2048, "3.0.1")


async def test_server_info_credentials_and_no_api(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    url = await serve({"GET /v1/models": answer(401, {"error": {"message": "Invalid API key", "type": "auth",
                                                                "code": 401}})})
    with pytest.raises(Unauthenticated, match="Invalid API key"):
        await client_for(url, vocab_size=5).server_info()
    url = await serve({"GET /health": answer(200, "ok")})
    with pytest.raises(TransportError, match="not an OpenAI-compatible server") as caught:
        await client_for(url, vocab_size=5).server_info()
    assert status_code_of(caught.value) is grpc.StatusCode.UNIMPLEMENTED


# -- construction and the pool ---------------------------------------------------------------------

def test_tls_with_a_plain_http_target_is_refused() -> None:
    with pytest.raises(ValueError, match="http://.*tls"):
        OpenAIClient("http://127.0.0.1:8080", ChannelSecurity(tls=TlsConfig()))
    assert OpenAIClient("127.0.0.1:8080").target == "http://127.0.0.1:8080"
    assert OpenAIClient("127.0.0.1:8443", ChannelSecurity(tls=TlsConfig())).target == "https://127.0.0.1:8443"


async def test_set_concurrency_grows_the_pool_for_the_next_requests(
        serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    url = await serve({"POST /v1/completions": sse([token("a"), 0.15, llama_final(completion_tokens=1), "[DONE]"])})
    client = client_for(url, concurrency=1)
    started = time.perf_counter()
    await asyncio.gather(*(collect(client.decode(SPEC, timeout=5)) for _ in range(3)))
    serial = time.perf_counter() - started
    client.set_concurrency(3)
    started = time.perf_counter()
    results = await asyncio.gather(*(collect(client.decode(SPEC, timeout=5)) for _ in range(3)))
    assert all(r[-1].finish_reason == "LENGTH" for r in results)
    assert serial >= 0.45 and time.perf_counter() - started < 0.4  # one connection each, at once


async def test_mutual_tls_and_server_name(serve: Serve, client_for: Callable[..., OpenAIClient],
                                          tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(certs.ca))
    server_tls.load_cert_chain(certs.server_cert, certs.server_key)
    server_tls.verify_mode = ssl.CERT_REQUIRED
    url = await serve({"GET /health": answer(200, "ok")}, tls=server_tls)
    tls = TlsConfig(server_name="localhost", ca_pem=certs.ca.read_bytes(), cert_pem=certs.client_cert.read_bytes(),
                    key_pem=certs.client_key.read_bytes())
    assert await client_for(url, security=ChannelSecurity(tls=tls)).is_serving()
    no_client_cert = TlsConfig(ca_pem=certs.ca.read_bytes())
    assert not await client_for(url, security=ChannelSecurity(tls=no_client_cert)).is_serving()
    assert not await client_for(url).is_serving()  # the system's roots do not know the test CA


# -- prompts as text and chat ----------------------------------------------------------------------

def text_spec(**prompt: Any) -> DecodeSpec:
    return DecodeSpec(request_id="t", prompt_token_ids=(), max_new_tokens=8, ignore_eos=True, temperature=0.7,
                      top_p=0.9, top_k=5, seed=3, **prompt)


SAMPLING = {"max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.7,
            "top_p": 0.9, "seed": 3, "top_k": 5, "ignore_eos": True}


async def test_a_text_prompt_is_a_string(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    record: list[dict[str, Any]] = []
    url = await serve({"POST /v1/completions": sse([token("a"), llama_final(completion_tokens=1), "[DONE]"],
                                                   record=record)})
    chunks = await collect(client_for(url, model="m").decode(text_spec(prompt_text="Once upon a time"), timeout=5))
    assert [c.text for c in chunks] == ["a", ""]
    assert record[0]["json"] == {"model": "m", "prompt": "Once upon a time", **SAMPLING}


def delta(content: str | None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": content, **extra}, "finish_reason": finish}],
            "object": "chat.completion.chunk"}


async def test_messages_go_to_the_chat_route_with_the_sampling_fields(
        serve: Serve, client_for: Callable[..., OpenAIClient], monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(openai_http, "tracer", provider.get_tracer("bench_client"))
    record: list[dict[str, Any]] = []
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}
    url = await serve({"POST /v1/chat/completions": sse(
        [delta(None, role="assistant"), 0.05, delta("Hel"), delta("lo"), delta(None, "length"), usage, "[DONE]"],
        record=record)})
    messages = (ChatTurn("system", "be brief"), ChatTurn("user", "hi"))
    started = time.perf_counter()
    chunks = await collect(client_for(url).decode(text_spec(messages=messages), timeout=5))
    # the role-only delta is no token: the first chunk, TTFT's, is the first content delta
    assert [(c.text, c.num_tokens) for c in chunks] == [("Hel", 1), ("lo", 1), ("", 0)]
    assert chunks[0].received_at - started >= 0.05
    assert (chunks[-1].finish_reason, chunks[-1].prompt_tokens, chunks[-1].completion_tokens) == ("LENGTH", 9, 2)
    assert record[0]["json"] == {"messages": [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "hi"}], **SAMPLING}
    [span] = exporter.get_finished_spans()
    assert span.name == "POST /v1/chat/completions" and span.attributes is not None
    assert span.attributes["gen_ai.operation.name"] == "chat" and span.attributes["gen_ai.usage.input_tokens"] == 9


def test_the_chat_preview_and_the_decode_of_messages_share_chat_body() -> None:
    preview = ChatSpec("c", (ChatTurn("user", "hi"),), 8, 0.0, 3, stop=("\n",), json_schema='{"type": "object"}',
                       top_logprobs=2)
    assert openai_json.chat_body(preview, "m") == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0.0,
        "seed": 3, "stream": True, "stream_options": {"include_usage": True}, "stop": ["\n"],
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}},
        "logprobs": True, "top_logprobs": 2}
    decode = text_spec(messages=(ChatTurn("user", "hi"),))
    assert openai_json.chat_body(decode, None) == {"messages": [{"role": "user", "content": "hi"}], **SAMPLING}


# -- tokenize --------------------------------------------------------------------------------------

TOKENIZE_BODY = {"content": "hello world", "prompt": "hello world", "inputs": "hello world",
                 "add_special_tokens": False}


def recorded(status: int, body: Any, record: list[dict[str, Any]]) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        record.append(await request.json())
        return web.json_response(body, status=status)
    return handler


@pytest.mark.parametrize("answer_body", [
    {"tokens": [15, 2088]},  # llama-server
    {"tokens": [15, 2088], "count": 2, "max_model_len": 2048},  # vLLM
    {"tokens": [{"id": 15, "piece": "hello"}, {"id": 2088, "piece": " world"}]},  # llama-server, with_pieces
    [{"id": 1, "text": "", "start": 0, "stop": 0}, {"id": 15, "text": "hello", "start": 0, "stop": 5},  # TGI
     {"id": 2088, "text": " world", "start": 5, "stop": 11}],
], ids=["llama-server", "vllm", "llama-server-pieces", "tgi"])
async def test_tokenize(serve: Serve, client_for: Callable[..., OpenAIClient], answer_body: Any) -> None:
    record: list[dict[str, Any]] = []
    url = await serve({"POST /tokenize": recorded(200, answer_body, record)})
    client = client_for(url, model="m")
    assert await client.tokenize("hello world") == [15, 2088]
    assert record == [{"model": "m", **TOKENIZE_BODY}]


async def test_tokenize_without_the_route(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    url = await serve({"GET /health": answer(200, "ok")})  # aiohttp: 405 for a POST to /health, 404 elsewhere
    with pytest.raises(NoTokenizeEndpoint) as caught:
        await client_for(url).tokenize("hello")
    assert str(caught.value) == f"{url}/tokenize answered HTTP 404: the server has no tokenize endpoint"


async def test_tokenize_failures(serve: Serve, client_for: Callable[..., OpenAIClient]) -> None:
    url = await serve({"POST /tokenize": answer(500, {"error": {"code": 500, "message": "tokenizer crashed",
                                                                "type": "server_error"}})})
    with pytest.raises(TransportError, match="^tokenizer crashed$") as failed:
        await client_for(url).tokenize("hello")
    assert failed.value.http_status == 500
    url = await serve({"POST /tokenize": answer(200, {"ids": [1]})})
    with pytest.raises(TransportError) as odd:
        await client_for(url).tokenize("hello")
    assert odd.value.message == f"""{url}/tokenize: unreadable answer (no tokens): '{{"ids": [1]}}'"""
    with pytest.raises(EngineUnavailable, match="refused"):
        await client_for(f"http://127.0.0.1:{free_port()}").tokenize("hello")


# -- connections -----------------------------------------------------------------------------------

SSE_BODY = "".join(f"data: {json.dumps(e)}\n\n" for e in (token("a"), llama_final(completion_tokens=1))) + \
    "data: [DONE]\n\n"
SSE_ANSWER = (f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: {len(SSE_BODY)}\r\n\r\n"
              f"{SSE_BODY}").encode()


class SilentServer:
    """HTTP/1.1 on raw sockets, in threads of its own (its closes are not the client loop's doing):
    each request on a keep-alive connection gets SSE_ANSWER, unless `drop(connection, request)` (both
    1-based) says to close the connection silently instead, the request unanswered, or the connection
    stays idle `idle_close_s` (cpp-httplib's keep-alive timeout, shortened). `reset`: close with RST
    (SO_LINGER 0) rather than FIN. `requests` lists (connection, request) as they came."""

    def __init__(self, drop: Callable[[int, int], bool] = lambda c, r: False, *, reset: bool = False,
                 idle_close_s: float | None = None) -> None:
        self.drop, self.reset, self.idle_close_s = drop, reset, idle_close_s
        self.requests: list[tuple[int, int]] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            self._connections += 1
            threading.Thread(target=self._serve, args=(conn, self._connections), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        with conn:
            buffer, count = b"", 0
            while True:
                conn.settimeout(self.idle_close_s if count else None)
                try:
                    while b"\r\n\r\n" not in buffer:
                        data = conn.recv(65536)
                        if not data:
                            return
                        buffer += data
                except TimeoutError:
                    return self._close(conn)  # idle too long: closed without a word, as cpp-httplib does
                conn.settimeout(None)
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                while len(buffer) < length:
                    buffer += conn.recv(65536)
                buffer = buffer[length:]
                count += 1
                self.requests.append((number, count))
                if self.drop(number, count):
                    return self._close(conn)
                conn.sendall(SSE_ANSWER)

    def _close(self, conn: socket.socket) -> None:
        if self.reset:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()


@pytest.fixture
def silent_server() -> Iterator[Callable[..., SilentServer]]:
    started: list[SilentServer] = []

    def start(*args: Any, **kwargs: Any) -> SilentServer:
        server = SilentServer(*args, **kwargs)
        started.append(server)
        return server
    yield start
    for server in started:
        server.close()


def capture_log(monkeypatch: pytest.MonkeyPatch) -> LogCapture:
    captured = LogCapture()
    monkeypatch.setattr(openai_pool, "log", structlog.wrap_logger(None, processors=[captured],
                                                                  wrapper_class=structlog.BoundLogger))
    return captured


@pytest.mark.parametrize(("reset", "error"), [(False, "ServerDisconnectedError: Server disconnected"),
                                              (True, f"ClientOSError: [Errno {errno.ECONNRESET}] "
                                                     f"{os.strerror(errno.ECONNRESET)}")],
                         ids=["fin", "rst"])
async def test_a_dead_pooled_connection_is_resent_on_a_fresh_one(
        silent_server: Callable[..., SilentServer], client_for: Callable[..., OpenAIClient],
        monkeypatch: pytest.MonkeyPatch, reset: bool, error: str) -> None:
    log = capture_log(monkeypatch)
    server = silent_server(lambda connection, request: (connection, request) == (1, 2), reset=reset)
    client = client_for(server.url)
    await collect(client.decode(SPEC, timeout=5))
    chunks = await collect(client.decode(SPEC, timeout=5))  # on connection 1 again, which dies unanswered
    assert [(c.text, c.finish_reason) for c in chunks] == [("a", None), ("", "LENGTH")]  # complete, no error
    assert server.requests == [(1, 1), (1, 2), (2, 1)]
    assert client.stale_connection_resends == 1
    assert log.entries == [{"event": "stale_connection_resent", "url": server.url + "/v1/completions",
                            "error": error, "log_level": "debug"}]


@pytest.mark.parametrize(("same_iteration", "error"), [
    (False, "ServerDisconnectedError: Server disconnected"),
    (True, "ClientOSError: [Errno None] Can not write request body for {url}"),
], ids=["fin-after-the-body", "fin-before-the-body"])
async def test_a_connection_closed_while_the_client_was_busy(
        silent_server: Callable[..., SilentServer], client_for: Callable[..., OpenAIClient],
        monkeypatch: pytest.MonkeyPatch, same_iteration: bool, error: str) -> None:
    # The server closes an idle keep-alive connection (cpp-httplib after 5 s; 0.05 s here) while the
    # client's event loop is busy, so that the client picks it from the pool before it sees the FIN.
    # When the loop reads the FIN in the iteration that picked the connection, before the task that
    # writes the body runs, aiohttp says "Can not write request body" (the llama-server sweep's error).
    log = capture_log(monkeypatch)
    server = silent_server(idle_close_s=0.05)
    client = client_for(server.url)
    await collect(client.decode(SPEC, timeout=5))
    time.sleep(0.3)  # blocks the loop: a busy client
    if same_iteration:
        await asyncio.sleep(0)  # the next iteration reads the FIN, then runs this task: the pick, the headers
    chunks = await collect(client.decode(SPEC, timeout=5))
    assert chunks[-1].finish_reason == "LENGTH" and client.stale_connection_resends == 1
    assert server.requests == [(1, 1), (2, 1)]  # the dead connection's server side never read the request
    url = server.url + "/v1/completions"
    assert [(e["event"], e["url"], e["error"]) for e in log.entries] == [
        ("stale_connection_resent", url, error.format(url=url))]


async def test_a_second_failure_raises(silent_server: Callable[..., SilentServer],
                                       client_for: Callable[..., OpenAIClient]) -> None:
    server = silent_server(lambda connection, request: (connection, request) != (1, 1))  # the fresh one dies too
    client = client_for(server.url)
    await collect(client.decode(SPEC, timeout=5))
    _, err = await collect_until_error(client.decode(SPEC, timeout=5))
    assert type(err) is EngineUnavailable
    assert err.message == (f"{server.url}/v1/completions: connection failed before the answer: "
                           "ServerDisconnectedError: Server disconnected")
    assert server.requests == [(1, 1), (1, 2), (2, 1)] and client.stale_connection_resends == 1


async def test_a_fresh_connection_that_dies_is_not_resent(silent_server: Callable[..., SilentServer],
                                                          client_for: Callable[..., OpenAIClient]) -> None:
    server = silent_server(lambda connection, request: True)
    client = client_for(server.url)
    _, err = await collect_until_error(client.decode(SPEC, timeout=5))
    assert type(err) is EngineUnavailable and "before the answer: ServerDisconnectedError" in err.message
    assert server.requests == [(1, 1)] and client.stale_connection_resends == 0


async def test_tokenize_is_resent_too(silent_server: Callable[..., SilentServer],
                                      client_for: Callable[..., OpenAIClient]) -> None:
    server = silent_server(lambda connection, request: (connection, request) == (1, 2))
    client = client_for(server.url)
    await collect(client.decode(SPEC, timeout=5))
    with pytest.raises(TransportError, match="unreadable answer"):  # it reached the server: SSE_ANSWER, no tokens
        await client.tokenize("hello")
    assert server.requests == [(1, 1), (1, 2), (2, 1)] and client.stale_connection_resends == 1


async def test_an_idle_connection_is_not_reused_past_the_keepalive_timeout(
        silent_server: Callable[..., SilentServer], client_for: Callable[..., OpenAIClient],
        monkeypatch: pytest.MonkeyPatch) -> None:
    server = silent_server()
    client = client_for(server.url)
    for _ in range(2):
        await collect(client.decode(SPEC, timeout=5))
    assert server.requests == [(1, 1), (1, 2)]  # within KEEPALIVE_TIMEOUT_S: the same connection
    monkeypatch.setattr(openai_pool, "KEEPALIVE_TIMEOUT_S", 0.1)
    client = client_for(server.url)
    await collect(client.decode(SPEC, timeout=5))
    await asyncio.sleep(0.3)
    await collect(client.decode(SPEC, timeout=5))
    assert server.requests[2:] == [(2, 1), (3, 1)]  # idle past it: a new connection
