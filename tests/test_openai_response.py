"""openai_response.Shaper: OpenAI's objects for each endpoint, whole and streamed, and each
endpoint's form of log-probabilities (pure, fast)."""

from __future__ import annotations

from engine_service.generation.controls import FinishReason
from engine_service.generation.logprobs import TokenLogprobs
from engine_service.transport.openai_request import parse_body
from engine_service.transport.openai_response import Shaper, Usage

PIECES = {1: "a", 2: "bc", 3: "é", 4: "d"}


def shaper(endpoint: str, **fields: object) -> Shaper:
    base = {"prompt": "hi"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    return Shaper(parse_body({**base, **fields}, endpoint, "", "m"), "r1", "m", PIECES.__getitem__)  # type: ignore[arg-type]


LPS = (TokenLogprobs(1, -0.5, ((1, -0.5), (2, -1.0), (4, -2.0))), TokenLogprobs(3, -0.25, ((3, -0.25), (1, -3.0))))
USAGE = Usage(prompt_tokens=5, completion_tokens=2, cached_tokens=1)


def test_usage() -> None:
    assert USAGE.json() == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                            "prompt_tokens_details": {"cached_tokens": 1}}


def test_a_whole_completion_and_chat() -> None:
    s = shaper("completions")
    body = s.whole("xy", FinishReason.LENGTH, None, None, USAGE)
    assert body["id"] == "cmpl-r1" and body["object"] == "text_completion" and body["model"] == "m"
    assert isinstance(body["created"], int) and body["usage"] == USAGE.json()
    assert body["choices"] == [{"index": 0, "text": "xy", "logprobs": None, "finish_reason": "length", "stop_reason": None}]
    c = shaper("chat").whole("xy", FinishReason.STOP, "END", None, USAGE)
    assert c["id"] == "chatcmpl-r1" and c["object"] == "chat.completion"
    assert c["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "xy"}, "logprobs": None,
                             "finish_reason": "stop", "stop_reason": "END"}]
    assert shaper("chat").whole("", FinishReason.EOS, None, None, USAGE)["choices"][0]["finish_reason"] == "stop"


def test_stream_chunks() -> None:
    s = shaper("completions", stream=True)
    chunk = s.chunk("x")
    assert chunk["object"] == "text_completion" and "usage" not in chunk
    assert chunk["choices"] == [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}]
    last = s.chunk("", finish=FinishReason.STOP, stop_reason=7)
    assert last["choices"][0]["finish_reason"] == "stop" and last["choices"][0]["stop_reason"] == 7
    u = shaper("completions", stream=True, stream_options={"include_usage": True})
    assert u.chunk("x")["usage"] is None
    assert u.usage_chunk(USAGE) == {"id": "cmpl-r1", "object": "text_completion", "created": u.created, "model": "m",
                                    "choices": [], "usage": USAGE.json()}
    c = shaper("chat", stream=True)
    assert c.chunk("", first=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert c.chunk("y")["choices"][0]["delta"] == {"content": "y"} and c.chunk("y")["object"] == "chat.completion.chunk"
    assert c.chunk("", finish=FinishReason.LENGTH)["choices"][0]["delta"] == {}
    assert c.chunk("z", finish=FinishReason.LENGTH)["choices"][0]["delta"] == {"content": "z"}
    assert c.chunk("")["choices"][0]["delta"] == {"content": ""}
    assert c.usage_chunk(USAGE)["object"] == "chat.completion.chunk"


def test_no_logprobs_unless_asked() -> None:
    assert shaper("completions").logprobs(LPS) is None
    assert shaper("chat").logprobs(LPS) is None


def test_completions_logprobs_with_offsets_and_an_echoed_prompt() -> None:
    s = shaper("completions", logprobs=2)
    got = s.logprobs(LPS)
    assert got == {"tokens": ["a", "é"], "token_logprobs": [-0.5, -0.25],
                   "top_logprobs": [{"a": -0.5, "bc": -1.0}, {"é": -0.25, "a": -3.0}], "text_offset": [0, 1]}
    assert s.logprobs(LPS[:1])["text_offset"] == [2]  # offsets run on through the stream
    echo = shaper("completions", logprobs=0, echo=True)
    got = echo.logprobs(LPS[1:], prompt=LPS[:1], first_prompt_token=2)
    assert got == {"tokens": ["bc", "a", "é"], "token_logprobs": [None, -0.5, -0.25],
                   "top_logprobs": [None, {}, {}], "text_offset": [0, 2, 3]}


def test_chat_logprobs_with_bytes() -> None:
    got = shaper("chat", logprobs=True, top_logprobs=1).logprobs(LPS)
    assert got == {"content": [
        {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}]},
        {"token": "é", "logprob": -0.25, "bytes": [195, 169],
         "top_logprobs": [{"token": "é", "logprob": -0.25, "bytes": [195, 169]}]}]}
    assert shaper("chat", logprobs=True).logprobs(LPS)["content"][0]["top_logprobs"] == []


def test_chat_chunks_in_full() -> None:
    c = shaper("chat", stream=True, logprobs=True)
    lp = {"content": []}
    head = {"id": "chatcmpl-r1", "object": "chat.completion.chunk", "created": c.created, "model": "m"}
    assert c.chunk("", first=True) == {**head, "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
    assert c.chunk("hi", lp) == {**head, "choices": [
        {"index": 0, "delta": {"content": "hi"}, "logprobs": lp, "finish_reason": None}]}
    assert c.chunk("", None, FinishReason.EOS) == {**head, "choices": [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop", "stop_reason": None}]}
    assert c.chunk("!", lp, FinishReason.STOP, "END") == {**head, "choices": [
        {"index": 0, "delta": {"content": "!"}, "logprobs": lp, "finish_reason": "stop", "stop_reason": "END"}]}
    assert c.chunk("a", first=True, finish=FinishReason.LENGTH)["choices"][0]["delta"] \
        == {"role": "assistant", "content": "a"}  # the first carries the role even when it is also the last


def test_completion_chunks_in_full() -> None:
    s = shaper("completions", stream=True, stream_options={"include_usage": True})
    head = {"id": "cmpl-r1", "object": "text_completion", "created": s.created, "model": "m"}
    assert s.chunk("x", {"tokens": []}) == {**head, "usage": None, "choices": [
        {"index": 0, "text": "x", "logprobs": {"tokens": []}, "finish_reason": None}]}
    assert s.chunk("", finish=FinishReason.LENGTH) == {**head, "usage": None, "choices": [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None}]}


def test_chat_logprob_bytes_are_utf8() -> None:
    pieces = {1: "€", 2: "\U0001f600", 3: " a"}
    s = Shaper(parse_body({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2},
                          "chat", "", "m"), "r", "m", pieces.__getitem__)
    got = s.logprobs([TokenLogprobs(1, -1.0, ((2, -0.5), (3, -0.75), (1, -1.0)))])
    assert got == {"content": [{"token": "€", "logprob": -1.0, "bytes": [0xE2, 0x82, 0xAC], "top_logprobs": [
        {"token": "\U0001f600", "logprob": -0.5, "bytes": [0xF0, 0x9F, 0x98, 0x80]},
        {"token": " a", "logprob": -0.75, "bytes": [32, 97]}]}]}
