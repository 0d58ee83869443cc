"""The HTTP adapter against TGI's shapes (tests/tgi_fake.py, after TGI's router source): a prompt of
token ids is refused (its `prompt` takes strings only), text and chat stream, top_p 1.0 is refused
inside the stream, /tokenize lists tokens with offsets, /info reports no vocabulary."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from bench_client.openai_errors import from_first_error_frame
from bench_client.openai_http import OpenAIClient
from bench_client.openai_json import completion_body
from bench_client.policy import Action, decide
from bench_client.server_api import ChatTurn, Chunk, DecodeSpec
from shared.errors import BadRequest, ContextLengthExceeded, EngineError, QueueFull, StreamError
from tests.tgi_fake import WORDS, TgiFake, start_tgi_fake, tgi_fake

pytestmark = pytest.mark.timeout(20)

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOP_P = "Input validation error: `top_p` must be > 0.0 and < 1.0"


@pytest.fixture
async def tgi() -> AsyncIterator[TgiFake]:
    async with tgi_fake() as fake:
        yield fake


@pytest.fixture
async def client(tgi: TgiFake) -> AsyncIterator[OpenAIClient]:
    made = OpenAIClient(tgi.url)
    yield made
    await made.close()


def spec(*, top_p: float = 0.9, max_new_tokens: int = 4, **prompt: Any) -> DecodeSpec:
    fields: dict[str, Any] = {"prompt_token_ids": (), **prompt}
    return DecodeSpec(request_id="r", max_new_tokens=max_new_tokens, ignore_eos=True, temperature=0.0, top_p=top_p,
                      top_k=0, seed=1, **fields)


async def collect(stream: AsyncIterator[Chunk] | Any) -> list[Chunk]:
    return [chunk async for chunk in stream]


async def refusal(stream: Any) -> EngineError:
    with pytest.raises(EngineError) as caught:
        await collect(stream)
    return caught.value


async def test_token_ids_are_refused_as_tgi_refuses_them(tgi: TgiFake, client: OpenAIClient) -> None:
    ids = spec(prompt_token_ids=(5, 6, 7))
    stream = client.decode(ids, timeout=5)
    err = await refusal(stream)
    sent = json.dumps(completion_body(ids, None))  # as aiohttp writes it: one line
    column = sent.index("]") + 1  # serde_json's position: the end of the `prompt` array
    assert type(err) is BadRequest and err.http_status == 422
    assert err.message == ("Failed to deserialize the JSON body into the target type: prompt: data did not match "
                           f"any variant of untagged enum PromptDeserializer at line 1 column {column}")
    assert decide(err, first_token_seen=False) is Action.SKIP_POINT
    assert stream.replica == tgi.url


@pytest.mark.parametrize("top_p", [0.9, 0.5])
async def test_a_text_prompt_streams(tgi: TgiFake, client: OpenAIClient, top_p: float) -> None:
    chunks = await collect(client.decode(spec(prompt_text="Once upon a time", top_p=top_p), timeout=5))
    assert [(c.text, c.num_tokens) for c in chunks] == [(w, 1) for w in WORDS[:4]]
    last = chunks[-1]
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == ("LENGTH", 17, 4)  # BOS + 16 bytes
    [(path, sent)] = tgi.requests
    assert path == "/v1/completions" and sent["prompt"] == "Once upon a time" and sent["top_p"] == top_p


@pytest.mark.parametrize("messages", [False, True], ids=["completions", "chat"])
async def test_top_p_1_is_refused_inside_the_stream(tgi: TgiFake, client: OpenAIClient, messages: bool) -> None:
    prompt: dict[str, Any] = ({"messages": (ChatTurn("user", "hi"),)} if messages
                              else {"prompt_text": "Once upon a time"})
    err = await refusal(client.decode(spec(top_p=1.0, **prompt), timeout=5))
    assert type(err) is BadRequest and err.message == TOP_P and err.http_status == 422
    assert err.metadata == {"httpStatus": "422", "errorType": "validation"}
    assert decide(err, first_token_seen=False) is Action.SKIP_POINT


async def test_tgi_answers_a_streamed_refusal_with_200(tgi: TgiFake) -> None:
    async with aiohttp.ClientSession() as session, session.post(tgi.url + "/v1/completions", json={
            "prompt": "hi", "top_p": 1.0, "stream": True}) as response:
        assert response.status == 200 and response.content_type == "text/event-stream"
        frame = json.dumps({"error": {"message": TOP_P, "http_status_code": 422}})
        assert await response.text() == f"data: {frame}\n\ndata: [DONE]\n\n"
    async with aiohttp.ClientSession() as session, session.post(tgi.url + "/v1/completions", json={
            "prompt": "hi", "top_p": 1.0}) as response:  # unstreamed: a 422
        assert response.status == 422 and await response.json() == {"error": TOP_P, "error_type": "validation"}


async def test_a_context_overflow_is_the_context_refusal() -> None:
    async with tgi_fake(max_total_tokens=16) as tgi:
        client = OpenAIClient(tgi.url)
        try:
            err = await refusal(client.decode(spec(prompt_text="hello world", max_new_tokens=8), timeout=5))
        finally:
            await client.close()
    assert type(err) is ContextLengthExceeded
    assert err.message == ("Input validation error: `inputs` tokens + `max_new_tokens` must be <= 16. Given: 12 "
                           "`inputs` tokens and 8 `max_new_tokens`")
    assert (err.metadata["promptTokens"], err.metadata["maxContextTokens"], err.metadata["maxNewTokens"]) == \
        ("12", "16", "8")
    assert decide(err, first_token_seen=False) is Action.SKIP_POINT


async def test_chat_streams(tgi: TgiFake, client: OpenAIClient) -> None:
    messages = (ChatTurn("system", "be brief"), ChatTurn("user", "hi"))
    chunks = await collect(client.decode(spec(messages=messages, max_new_tokens=3), timeout=5))
    assert [(c.text, c.num_tokens) for c in chunks] == [(w, 1) for w in WORDS[:3]]
    rendered = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (chunks[-1].finish_reason, chunks[-1].prompt_tokens, chunks[-1].completion_tokens) == \
        ("LENGTH", len(rendered.encode()) + 1, 3)
    [(path, sent)] = tgi.requests
    assert path == "/v1/chat/completions"
    assert sent["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


async def test_tokenize(tgi: TgiFake, client: OpenAIClient) -> None:
    assert await client.tokenize("héllo") == [b + 3 for b in "héllo".encode()]  # TGI's BOS dropped
    [(path, sent)] = tgi.requests
    assert path == "/tokenize" and sent["inputs"] == "héllo"


async def test_server_info_without_a_vocabulary(tgi: TgiFake, client: OpenAIClient) -> None:
    info = await client.server_info()
    assert (info.model, info.max_context_tokens, info.engine_version, info.vocab_size) == (MODEL, 2048, "3.3.6", 0)
    assert set(info.reported) == {"models", "info"}  # no /props, no /version: passed over
    await collect(client.decode(spec(prompt_text="hi"), timeout=5))
    assert tgi.requests[-1][1]["model"] == MODEL  # named in each request once the server said it


async def test_the_fake_takes_a_list_of_strings_and_refuses_an_empty_one() -> None:
    url, stop = await start_tgi_fake()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1}) as response:
                answer = await response.json()
            assert [(c["index"], c["text"]) for c in answer["choices"]] == [(0, "The"), (1, "The")]
            async with session.post(url + "/v1/completions", data='{"prompt": []}',
                                    headers={"Content-Type": "application/json"}) as response:
                assert response.status == 422 and await response.text() == (
                    "Failed to deserialize the JSON body into the target type: prompt: Empty array detected. Do not "
                    "use an empty array for the prompt. at line 1 column 13")
    finally:
        await stop()


def test_tgis_other_first_frames() -> None:
    overloaded = from_first_error_frame({"error": {"message": "Model is overloaded", "http_status_code": 422}})
    assert type(overloaded) is QueueFull and overloaded.http_status == 429
    assert decide(overloaded, first_token_seen=False) is Action.RETRY_AFTER_BACKOFF
    failed = from_first_error_frame({"error": {"message": "Request failed during generation: CUDA OOM",
                                               "http_status_code": 422}})
    assert type(failed) is StreamError and failed.message == "Request failed during generation: CUDA OOM"
    assert decide(failed, first_token_seen=False) is Action.COUNT_FAILED
    by_type = from_first_error_frame({"error": TOP_P, "error_type": "validation"})
    assert type(by_type) is BadRequest and by_type.message == TOP_P
