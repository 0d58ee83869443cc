"""The engine's OpenAI-compatible HTTP front, called by the official `openai` SDK (nobody here wrote
it) and by plain aiohttp where the SDK cannot say it (bad bytes, headers): the same engine as the
gRPC front, the same answers, every refusal as the SDK's own exception class with our message.

One SmolLM2 engine (it has a chat template) serves the module; the tests that need another engine
(a queue of one, a fault) start a tiny one of their own."""

from __future__ import annotations

import asyncio
import json
import ssl

import aiohttp
import grpc
import jsonschema
import openai
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.v1 import engine_pb2 as pb
from engine.v1 import engine_pb2_grpc
from engine_service.config import EngineConfig, ServerConfig
from engine_service.faults import FaultPlan
from engine_service.runtime.build import build_engine
from engine_service.transport import http_front
from engine_service.transport.engine_slot import EngineSlot
from engine_service.transport.metrics import EngineMetrics, disabled_meter
from engine_service.transport.server import create_server, set_health
from engine_service.transport.telemetry import RequestTelemetry
from tests.certs import make_certs

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "The three primary colours are"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


class Front:
    def __init__(self, running, exporter: InMemorySpanExporter) -> None:  # type: ignore[no-untyped-def]
        self.running = running
        self.engine = running.slot.ready_engine()
        self.exporter = exporter
        self.url = f"http://127.0.0.1:{running.http_port}"
        self.sdk = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)

    async def post(self, path: str, data: bytes | str, headers: dict[str, str] | None = None
                   ) -> tuple[int, dict, dict]:  # type: ignore[type-arg]
        async with aiohttp.ClientSession() as session, session.post(
                self.url + path, data=data, headers=headers or {"Content-Type": "application/json"}) as resp:
            text = await resp.text()
            return resp.status, json.loads(text), dict(resp.headers)


async def _front(config: EngineConfig, server: ServerConfig | None = None, exporter: InMemorySpanExporter | None = None
                 ):  # type: ignore[no-untyped-def]
    exporter = exporter or InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = await build_engine(config)
    slot = EngineSlot.holding(engine)
    telemetry = RequestTelemetry(EngineMetrics(disabled_meter(), slot.load, slot.waiting), provider.get_tracer("t"))
    running = await create_server(slot, server or ServerConfig(port=0, http_port=0), telemetry)
    await running.server.start()
    await set_health(running, 1)  # SERVING
    return Front(running, exporter)


async def _stop(front: Front) -> None:
    await front.sdk.close()
    await front.channel.close()
    front.engine.stop()
    await front.running.stop(0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def front():  # type: ignore[no-untyped-def]
    # no prefix cache: these tests compare one request's greedy text across calls and fronts, and a
    # cached prefix changes its path (the rest of the prompt as a chunk at an offset, not one whole
    # prefill), which in bfloat16 moves last bits and, on some CPUs, a greedy token (a Xeon of
    # family 6 model 207: "a rare and precious one" whole, "a very rare and precious" cached)
    served = await _front(EngineConfig(model="smollm2", max_batch=4, max_context=512, max_new_tokens_limit=256,
                                       prefix_cache_tokens=0, compile_decode="off"))
    yield served
    await _stop(served)


async def _grpc_text(front: Front, **fields) -> tuple[str, list[pb.DecodeResponse]]:  # type: ignore[no-untyped-def]
    responses = [r async for r in front.stub.Decode(pb.DecodeRequest(**fields))]
    return "".join(r.text for r in responses), responses


# -- answers ---------------------------------------------------------------------------------------

async def test_a_completion_is_the_grpc_decode_of_the_same_request(front: Front) -> None:
    got = await front.sdk.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True})
    text, responses = await _grpc_text(front, prompt_text=PROMPT, max_new_tokens=12, ignore_eos=True)
    assert got.choices[0].text == text and text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 12 == responses[-1].usage.completion_tokens
    assert got.usage.prompt_tokens == responses[-1].usage.prompt_tokens
    assert got.id.startswith("cmpl-") and got.model == "smollm2"


async def test_a_streamed_completion_joins_to_the_whole_one(front: Front) -> None:
    whole = await front.sdk.completions.create(prompt=PROMPT, max_tokens=10, temperature=0, model="smollm2")
    stream = await front.sdk.completions.create(prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                                model="smollm2", stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


async def test_chat_streaming_gives_the_role_then_the_content_then_the_usage(front: Front) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = await front.sdk.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0)
    stream = await front.sdk.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0,
                                                     stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content and content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 8
    text, _ = await _grpc_text(front, chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="Name a colour.")]),
                               max_new_tokens=8)
    assert text == content


async def test_chat_without_max_tokens_gets_what_the_context_leaves(front: Front) -> None:
    # --max-new-tokens 256 < 512 - prompt: the limit; a prompt of 400 tokens leaves 112
    long = "word " * 395
    got = await front.sdk.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": long}],
                                                  temperature=0, extra_body={"ignore_eos": True})
    assert got.usage.prompt_tokens + got.usage.completion_tokens == 512
    assert got.choices[0].finish_reason == "length"


async def test_logprobs_in_each_endpoints_form_are_the_grpc_ones(front: Front) -> None:
    got = await front.sdk.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    _, responses = await _grpc_text(front, prompt_text=PROMPT, max_new_tokens=4, top_logprobs=3)
    expected = [lp for r in responses for lp in r.logprobs]
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected], abs=1e-5)
    assert lp.tokens == [e.text for e in expected]
    assert [list(t) for t in lp.top_logprobs] == [[a.text for a in e.top] for e in expected]
    chat = await front.sdk.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy: the most likely
    assert all(bytes(c.bytes).decode() == c.token for c in content)


async def test_echo_with_logprobs_scores_the_prompt(front: Front) -> None:
    got = await front.sdk.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2, temperature=0, logprobs=0,
                                             echo=True)
    choice = choice_text = got.choices[0]
    prompt_tokens = got.usage.prompt_tokens
    assert choice_text.text.startswith(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == prompt_tokens + 2 and lp.token_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])


async def test_a_json_schema_constrains_the_answer(front: Front) -> None:
    got = await front.sdk.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Give a person as JSON."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    jsonschema.validate(json.loads(got.choices[0].message.content), SCHEMA)
    loose = await front.sdk.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Any JSON."}], max_tokens=40, temperature=0,
        response_format={"type": "json_object"})
    if loose.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(loose.choices[0].message.content), dict)


async def test_stop_strings_end_the_answer_and_are_named(front: Front) -> None:
    base = await front.sdk.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0)
    word = base.choices[0].text.split()[1]
    got = await front.sdk.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, stop=[word])
    assert got.choices[0].finish_reason == "stop" and word not in got.choices[0].text
    assert got.model_extra is not None and got.choices[0].model_extra["stop_reason"] == word


async def test_seeded_sampling_repeats_and_an_unknown_field_is_ignored(front: Front) -> None:
    ask = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 11, "user": "someone",
           "extra_body": {"no_such_field": [1, 2], "repetition_penalty": 1.1, "top_k": 20, "min_p": 0.05}}
    a = await front.sdk.completions.create(**ask)
    b = await front.sdk.completions.create(**ask)
    assert a.choices[0].text == b.choices[0].text


async def test_models_health_tokenize_detokenize(front: Front) -> None:
    models = await front.sdk.models.list()
    assert [m.id for m in models.data] == ["smollm2"] and models.data[0].model_extra["max_model_len"] == 512
    status, body, _ = await front.post("/tokenize", json.dumps({"prompt": "hello world", "return_token_strs": True}))
    grpc_ids = list((await front.stub.Tokenize(pb.TokenizeRequest(text="hello world"))).token_ids)
    assert status == 200 and body["tokens"] == grpc_ids and body["count"] == len(grpc_ids) and body["max_model_len"] == 512
    assert "".join(body["token_strs"]).replace("Ġ", " ").endswith("hello world")
    _, plain, _ = await front.post("/tokenize", json.dumps({"prompt": "hello world", "add_special_tokens": False}))
    assert plain["tokens"] == grpc_ids[-len(plain["tokens"]):]
    _, chat, _ = await front.post("/tokenize", json.dumps({"messages": [{"role": "user", "content": "Hi"}]}))
    assert chat["count"] > 3
    status, text, _ = await front.post("/detokenize", json.dumps({"tokens": plain["tokens"]}))
    assert status == 200 and text == {"prompt": "hello world"}
    async with aiohttp.ClientSession() as session, session.get(front.url + "/health") as resp:
        assert resp.status == 200


# -- refusals, as the SDK's own exceptions ------------------------------------------------------------

@pytest.mark.parametrize(("ask", "param", "words"), [
    ({"max_tokens": "many"}, "max_tokens", "max_tokens must be an integer, got a string \"many\""),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be 1..256, got 0"),
    ({"temperature": -1}, "temperature", "temperature must be finite and in [0, 100], got -1.0"),
    ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5"),
    ({"n": 2}, "n", "n must be 1 (one choice per request is served), got 2"),
    ({"prompt": ["a", "b"]}, "prompt", "prompt must be one prompt (several in one request are not served), got 2"),
    ({"prompt": [1, 2, 10**6]}, "prompt", "prompt[2] must be < vocab_size 49152, got 1000000"),
    ({"stop": ["x"] * 9}, "stop", "stop must hold at most 8 strings, got 9"),
    ({"logprobs": 21}, "logprobs", "logprobs must be 0..20, got 21"),
    ({"extra_body": {"min_tokens": 300}}, "min_tokens", "min_tokens must be at most max_tokens 16, got 300"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "logit_bias keys must be token ids, got 'x'"),
    ({"model": "gpt-4"}, "model", "model must be 'smollm2'"),
])
async def test_a_bad_field_is_a_400_naming_it(front: Front, ask: dict, param: str, words: str) -> None:
    fields = {"model": "smollm2", "prompt": PROMPT, **ask}
    with pytest.raises(openai.BadRequestError) as caught:
        await front.sdk.completions.create(**fields)
    err = caught.value
    assert err.status_code == 400 and err.param == param and err.type == "INVALID_FIELD"
    assert words in err.body["message"]


async def test_chat_fields_are_named_as_chat_names_them(front: Front) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await front.sdk.chat.completions.create(model="smollm2", messages=[{"role": "", "content": "x"}])
    assert caught.value.param == "messages[0].role" and "messages[0].role must not be empty" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        await front.sdk.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}],
                                                max_completion_tokens=10**6)
    assert caught.value.param == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as caught:
        await front.sdk.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert caught.value.param == "top_logprobs"


async def test_a_context_too_long_reads_as_vllms_and_as_ours(front: Front) -> None:
    from bench_client.openai_errors import from_http_response
    from shared.errors import ContextLengthExceeded

    prompt = "word " * 300
    count = len((await front.stub.Tokenize(pb.TokenizeRequest(text=prompt))).token_ids)
    with pytest.raises(openai.BadRequestError) as caught:
        await front.sdk.completions.create(model="smollm2", prompt=prompt, max_tokens=250)
    err = caught.value
    assert err.type == "CONTEXT_LENGTH_EXCEEDED" and err.param is None
    assert err.body["message"].startswith(f"This model's maximum context length is 512 tokens. However, you requested "
                                          f"{count + 250} tokens ({count} in the messages, 250 in the completion).")
    ours = from_http_response(400, {}, err.response.content)
    assert isinstance(ours, ContextLengthExceeded)
    assert (ours.metadata["promptTokens"], ours.metadata["maxContextTokens"]) == (str(count), "512")


async def test_bad_bytes_are_400s_and_a_huge_body_is_413(front: Front) -> None:
    for raw, words in [(b'{"prompt": "x",', "body must be a JSON object in UTF-8"),
                       (b'\xff\xfe{"prompt": 1}', "body must be a JSON object in UTF-8"),
                       (b'[1, 2]', "body must be a JSON object, got [1, 2]"),
                       (b'[' * 100_000, "nested less deeply"),
                       (b'{"prompt": "\\ud800"}', "prompt must be valid Unicode")]:
        status, body, _ = await front.post("/v1/completions", raw)
        assert (status, body["error"]["type"]) == (400, "INVALID_FIELD") and words in body["error"]["message"], raw[:20]
    status, body, _ = await front.post("/v1/completions", b'{"prompt": "' + b"x" * (5 * 2**20) + b'"}')
    assert status == 413 and body["error"]["code"] == 413
    status, body, _ = await front.post("/v1/nothing", b"{}")
    assert status == 404 and body["error"]["code"] == 404
    assert (await front.sdk.completions.create(model="smollm2", prompt="still", max_tokens=2)).usage.completion_tokens


async def test_a_bug_is_a_500_with_the_request_id_and_no_detail(front: Front, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("secret detail")

    monkeypatch.setattr(http_front.Shaper, "whole", broken)
    with pytest.raises(openai.InternalServerError) as caught:
        await front.sdk.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2,
                                           extra_headers={"X-Request-Id": "bug-1"})
    assert caught.value.status_code == 500 and caught.value.type == "INTERNAL"
    assert caught.value.body["message"] == "internal error while handling request bug-1; see the engine log"


async def test_a_deadline_is_408(front: Front) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        await front.sdk.completions.create(model="smollm2", prompt=PROMPT, max_tokens=256, temperature=0,
                                           extra_body={"ignore_eos": True}, extra_headers={"X-Request-Timeout": "0.2"})
    assert caught.value.status_code == 408 and caught.value.type == "DEADLINE_EXCEEDED"
    status, body, _ = await front.post("/v1/completions", json.dumps({"prompt": "x"}),
                                       {"Content-Type": "application/json", "X-Request-Timeout": "soon"})
    assert status == 400 and body["error"]["param"] == "X-Request-Timeout"


async def test_traceparent_continues_the_callers_trace(front: Front) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    front.exporter.clear()
    await front.sdk.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2, extra_headers={
        "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    spans = {s.name: s for s in front.exporter.get_finished_spans()}
    server = spans["POST /v1/completions"]
    assert format(server.context.trace_id, "032x") == trace_id and server.parent.span_id == 0x00f067aa0ba902b7
    assert server.attributes["http.response.status_code"] == 200
    assert {"engine.queue_wait", "engine.prefill", "engine.decode"} <= set(spans)


# -- engines of their own ---------------------------------------------------------------------------

async def test_queue_full_is_429_with_retry_after_and_draining_503() -> None:
    served = await _front(EngineConfig(model="tiny", max_batch=1, queue_capacity=1, max_context=4096,
                                       max_new_tokens_limit=4000, queue_retry_seconds=0.5))
    try:
        long = {"model": served.engine.info.model, "prompt": "x", "max_tokens": 4000, "temperature": 0,
                "extra_body": {"ignore_eos": True}, "stream": True}
        running = await served.sdk.completions.create(**long)
        first = await running.__anext__()  # decoding now
        assert first.choices[0].text is not None
        queued = asyncio.create_task(served.sdk.completions.create(**{**long, "stream": False, "max_tokens": 2}))
        while served.engine.waiting() == 0:
            await asyncio.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as caught:
            await served.sdk.completions.create(**{**long, "stream": False})
        assert caught.value.type == "QUEUE_FULL" and caught.value.response.headers["Retry-After"] == "1"
        served.engine.begin_drain(5.0)
        served.running.http.serving = False
        with pytest.raises(openai.InternalServerError) as caught:
            await served.sdk.completions.create(**{**long, "stream": False})
        assert caught.value.status_code == 503 and caught.value.type == "ENGINE_DRAINING"
        assert caught.value.response.headers["Retry-After"] == "1"
        async with aiohttp.ClientSession() as session, session.get(served.url + "/health") as resp:
            assert resp.status == 503 and (await resp.json()) == {"status": "draining"}
        await running.close()
        assert (await queued).usage.completion_tokens == 2  # admitted before the drain: served
    finally:
        await _stop(served)


async def test_a_sequence_aborted_mid_stream_ends_in_an_error_frame() -> None:
    served = await _front(EngineConfig(model="tiny", faults=FaultPlan.parse(["sequence-error:step=4"])))
    try:
        stream = await served.sdk.completions.create(model=served.engine.info.model, prompt="x", max_tokens=50,
                                                     stream=True, extra_body={"ignore_eos": True})
        texts = []
        with pytest.raises(openai.APIError) as caught:
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
        assert texts and "aborted after" in caught.value.message
        assert caught.value.body["type"] == "SEQUENCE_ABORTED"
        again = await served.sdk.completions.create(model=served.engine.info.model, prompt="x", max_tokens=3)
        assert again.usage.completion_tokens == 3 or again.choices[0].finish_reason == "stop"
    finally:
        await _stop(served)


async def test_the_bearer_token_and_tls_guard_the_front(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import httpx2 as httpx

    certs = make_certs(tmp_path)
    served = await _front(EngineConfig(model="tiny"), ServerConfig(
        port=0, http_port=0, auth_token="s3cret", tls_cert=certs.server_cert, tls_key=certs.server_key))
    url = f"https://localhost:{served.running.http_port}/v1"
    try:
        client = openai.AsyncOpenAI(base_url=url, api_key="wrong", max_retries=0,
                                    http_client=httpx.AsyncClient(verify=ssl.create_default_context(cafile=certs.ca)))
        with pytest.raises(openai.AuthenticationError) as caught:
            await client.completions.create(model=served.engine.info.model, prompt="x", max_tokens=2)
        assert caught.value.type == "UNAUTHENTICATED" and caught.value.response.headers["WWW-Authenticate"] == "Bearer"
        assert caught.value.body["message"] == "invalid bearer token for /v1/completions"
        await client.close()
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=certs.ca)) as plain:
            for path in ("/completions", "/models"):
                missing = await plain.post(url + path, json={"prompt": "x"}) if path == "/completions" \
                    else await plain.get(url + path)
                assert missing.status_code == 401
                assert missing.json()["error"]["message"] == f"missing bearer token for /v1{path}"
        client = openai.AsyncOpenAI(base_url=url, api_key="s3cret", max_retries=0,
                                    http_client=httpx.AsyncClient(verify=ssl.create_default_context(cafile=certs.ca)))
        got = await client.completions.create(model=served.engine.info.model, prompt="x", max_tokens=2)
        assert got.usage.completion_tokens >= 1
        await client.close()
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=certs.ca)) as plain:
            assert (await plain.get(f"https://localhost:{served.running.http_port}/health")).status_code == 200
    finally:
        await _stop(served)


async def test_health_is_503_while_the_model_loads() -> None:
    slot = EngineSlot()
    telemetry = RequestTelemetry(EngineMetrics(disabled_meter(), slot.load, slot.waiting))
    running = await create_server(slot, ServerConfig(port=0, http_port=0), telemetry)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{running.http_port}/health") as resp:
                assert resp.status == 503 and (await resp.json()) == {"status": "loading"}
            slot.fill(await build_engine(EngineConfig(model="tiny")))
            await set_health(running, 1)
            async with session.get(f"http://127.0.0.1:{running.http_port}/health") as resp:
                assert resp.status == 200
    finally:
        slot.ready_engine().stop()
        await running.stop(0)


async def test_one_process_serves_both_fronts_with_one_set_of_metrics() -> None:
    """`python -m engine_service --http-port 0`: the same engine over both; every request, either
    front, counted in the same metrics and told by the same `request_finished` event."""
    import urllib.error
    import urllib.request

    from tests.contract import decode
    from tests.engines import EngineProcess
    from tests.test_observability_metrics import scrape, series

    with EngineProcess("--model", "tiny", "--http-port", "0", "--metrics-port", "0") as proc:
        assert proc.http_port is not None and proc.http_port != proc.port
        url = f"http://127.0.0.1:{proc.http_port}/v1/completions"

        def post(body: dict) -> int:  # type: ignore[type-arg]
            request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                                "X-Request-Id": f"h{body['max_tokens']}"})
            try:
                with urllib.request.urlopen(request, timeout=30) as resp:
                    return resp.status
            except urllib.error.HTTPError as err:
                return err.code

        assert post({"prompt": "x", "max_tokens": 3, "temperature": 0}) == 200
        assert post({"prompt": "x", "max_tokens": 0}) == 400
        decode(proc.stub(), prompt_text="x", max_new_tokens=3)
        samples = scrape(proc.events_named("metrics_started")[0]["port"])
        assert series(samples, "engine_requests_total", status="OK", reason="") == [2.0]
        assert series(samples, "engine_requests_total", status="INVALID_ARGUMENT", reason="INVALID_FIELD") == [1.0]
        assert series(samples, "engine_generation_tokens_total") == [6.0]
        finished = proc.wait_events("request_finished", "h3")
        assert finished[0]["status"] == "OK" and finished[0]["output_tokens"] == 3
