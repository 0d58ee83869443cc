"""openai_request.parse_body: each OpenAI field into the DecodeRequest, each wrong type refused by
the body's name, and OpenAICall.rename giving the engine's refusals the body's names (pure, fast)."""

from __future__ import annotations

import json

import pytest

from engine_service.requests import Limits, Request
from engine_service.transport.openai_request import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    OpenAICall,
    parse_body,
)
from shared.errors import ContextLengthExceeded, InvalidField, QueueFull

MODEL = "smollm2"


def completion(**fields: object) -> OpenAICall:
    return parse_body({"prompt": "hi", **fields}, "completions", "", MODEL)


def chat(**fields: object) -> OpenAICall:
    return parse_body({"messages": [{"role": "user", "content": "hi"}], **fields}, "chat", "", MODEL)


def refusal(endpoint: str, body: object) -> InvalidField:
    with pytest.raises(InvalidField) as caught:
        parse_body(body, endpoint, "", MODEL)  # type: ignore[arg-type]
    return caught.value


def test_the_defaults_are_openais() -> None:
    call = completion()
    msg = call.message
    assert msg.prompt_text == "hi" and msg.max_new_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS == 16
    assert msg.sampling.temperature == 1.0 and msg.sampling.top_p == 0.0 and msg.sampling.top_k == 0
    assert 0 <= msg.sampling.seed < 2**63 and not msg.ignore_eos and msg.top_logprobs == 0
    assert not msg.echo_prompt_logprobs and not msg.HasField("response_format") and list(msg.stop) == []
    assert (call.stream, call.include_usage, call.echo, call.logprobs, call.alternatives) == (False, False, False, False, 0)
    assert call.max_tokens_default and call.max_tokens_name == "max_tokens" and call.endpoint == "completions"
    seeds = {completion().message.sampling.seed for _ in range(4)}
    assert len(seeds) == 4  # a random seed per request, as OpenAI samples
    assert chat().message.max_new_tokens == 0  # chat: set by the front from what the context leaves
    assert not completion(max_tokens=16).max_tokens_default


def test_every_field_reaches_the_decode_request() -> None:
    msg = completion(max_tokens=7, temperature=0, top_p=0.5, top_k=40, min_p=0.1, seed=9, repetition_penalty=1.2,
                     presence_penalty=0.5, frequency_penalty=-0.5, min_tokens=3, logit_bias={"5": -100, "7": 2.5},
                     stop="END", stop_token_ids=[3, 4], ignore_eos=True, user="u", model=MODEL).message
    s = msg.sampling
    assert msg.max_new_tokens == 7 and s.temperature == 0 and s.top_k == 40 and s.seed == 9
    assert (round(s.top_p, 6), round(s.min_p, 6), round(s.repetition_penalty, 6)) == (0.5, 0.1, 1.2)
    assert (s.presence_penalty, s.frequency_penalty, s.min_new_tokens) == (0.5, -0.5, 3)
    assert dict(s.logit_bias) == {5: -100.0, 7: 2.5}
    assert list(msg.stop) == ["END"] and list(msg.stop_token_ids) == [3, 4] and msg.ignore_eos
    assert completion(top_k=-1).message.sampling.top_k == 0  # vLLM's "every token"
    assert completion(max_tokens=16.0).message.max_new_tokens == 16
    assert list(completion(stop=["a", "b"]).message.stop) == ["a", "b"]


def test_prompt_forms() -> None:
    assert list(completion(prompt=[1, 2, 3]).message.prompt_token_ids.ids) == [1, 2, 3]
    assert list(completion(prompt=[[4, 5]]).message.prompt_token_ids.ids) == [4, 5]
    assert completion(prompt=["one"]).message.prompt_text == "one"
    assert completion(prompt=["one"]).message.WhichOneof("prompt") == "prompt_text"
    assert refusal("completions", {"prompt": []}).message == "prompt must not be empty, got []"
    assert refusal("completions", {}).field == "prompt"
    assert refusal("completions", {"prompt": 5}).message == "prompt must be a string or an array of token ids, got an integer 5"
    err = refusal("completions", {"prompt": [[1], [2]]})
    assert (err.field, err.message) == ("prompt", "prompt must be one prompt (several in one request are not served), got 2")
    assert refusal("completions", {"prompt": [1, -1]}).field == "prompt[1]"
    assert refusal("completions", {"prompt": [1, True]}).field == "prompt[1]"
    assert refusal("completions", {"prompt": [1, 2**32]}).field == "prompt[1]"
    assert completion(prompt=[2**32 - 1]).message.prompt_token_ids.ids[0] == 2**32 - 1


def test_messages_forms() -> None:
    msg = parse_body({"messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                   {"role": "assistant", "content": None}]}, "chat", "", MODEL).message
    assert [(m.role, m.content) for m in msg.chat.messages] == [("system", "be brief"), ("user", "ab"), ("assistant", "")]
    empty = parse_body({"messages": []}, "chat", "", MODEL).message
    assert empty.WhichOneof("prompt") == "chat" and len(empty.chat.messages) == 0
    assert refusal("chat", {}).field == "messages"
    assert refusal("chat", {"messages": {"role": "user"}}).field == "messages"
    assert refusal("chat", {"messages": ["hi"]}).field == "messages[0]"
    assert refusal("chat", {"messages": [{"content": "x"}]}).field == "messages[0].role"
    assert refusal("chat", {"messages": [{"role": "user", "content": 3}]}).field == "messages[0].content"
    err = refusal("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert err.field == "messages[0].content[0]" and "reads text only" in err.message and "'image_url'" in err.message
    assert refusal("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}).field \
        == "messages[0].content[0].text"


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_tokens", "8", 'max_tokens must be an integer, got a string "8"'),
    ("max_tokens", True, "max_tokens must be an integer, got a boolean true"),
    ("max_tokens", 1.5, "max_tokens must be an integer, got a number 1.5"),
    ("max_tokens", -1, "max_tokens must be an integer in 0..4294967295, got -1"),
    ("max_tokens", 2**32, "max_tokens must be an integer in 0..4294967295, got 4294967296"),
    ("temperature", "hot", 'temperature must be a number, got a string "hot"'),
    ("temperature", True, "temperature must be a number, got a boolean true"),
    ("top_p", [1], "top_p must be a number, got an array"),
    ("top_k", -2, "top_k must be an integer in -1..2147483647, got -2"),
    ("seed", -1, "seed must be an integer in 0..18446744073709551615, got -1"),
    ("min_tokens", "3", 'min_tokens must be an integer, got a string "3"'),
    ("ignore_eos", 1, "ignore_eos must be a boolean (true or false), got an integer 1"),
    ("stream", "yes", 'stream must be a boolean (true or false), got a string "yes"'),
    ("stop", 5, "stop must be a string or an array of strings, got an integer 5"),
    ("stop", ["a", 5], "stop[1] must be a string, got an integer 5"),
    ("stop_token_ids", [-1], "stop_token_ids[0] must be a token id (an integer >= 0), got an integer -1"),
    ("logit_bias", [1], "logit_bias must be an object of token id -> bias, got an array"),
    ("logit_bias", {"-1": 1}, "logit_bias keys must be token ids, got '-1'"),
    ("logit_bias", {"99999999999": 1}, "logit_bias keys must be token ids, got '99999999999'"),
    ("logit_bias", {"1": "x"}, 'logit_bias[1] must be a number, got a string "x"'),
    ("logit_bias", {"\u0663": 1}, "logit_bias keys must be token ids, got '\u0663'"),
    ("top_p", 0, "top_p must be in (0, 1], got 0.0"),
    ("repetition_penalty", 0, "repetition_penalty must be in (0, 10], got 0.0"),
    ("max_tokens", 10**50, "max_tokens must be an integer in 0..4294967295, got an integer of 51 digits"),
    ("seed", -(10**45), "seed must be an integer in 0..18446744073709551615, got an integer of 46 digits"),
    ("n", 2, "n must be 1 (one choice per request is served), got 2"),
    ("best_of", 3, "best_of must be 1 (one choice per request is served), got 3"),
    ("tools", [{"type": "function"}], 'tools are not served (no tool calling), got [{"type": "function"}]'),
    ("suffix", "end", 'suffix is not served (no insertion), got "end"'),
    ("model", "other", "model must be 'smollm2' (the one this engine serves) or absent, got 'other'"),
    ("model", 3, "model must be a string, got an integer 3"),
    ("logprobs", True, "logprobs must be an integer, got a boolean true"),
    ("echo", "true", 'echo must be a boolean (true or false), got a string "true"'),
    ("prompt", "\ud800x", "prompt must be valid Unicode, got a lone surrogate at character 0"),
])
def test_a_wrong_field_is_refused_by_its_name(field: str, value: object, message: str) -> None:
    err = refusal("completions", {"prompt": "hi", field: value})
    assert (err.field, err.message) == (message.split(" ")[0], message)  # the field named first, as it is
    assert err.reason == "INVALID_FIELD" and err.http_code == 400


def test_absent_and_null_are_the_same_and_served_defaults_pass() -> None:
    nulls = {k: None for k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs", "echo",
                               "stream", "stream_options", "response_format", "logit_bias", "n", "model", "suffix")}
    assert completion(**nulls).message.max_new_tokens == 16
    assert completion(n=1, best_of=1, tools=[], suffix="", echo=False).message.prompt_text == "hi"


def test_chat_refuses_echo_and_top_logprobs_without_logprobs() -> None:
    assert refusal("chat", {"messages": [{"role": "user", "content": "x"}], "echo": True}).message \
        == "echo is served on /v1/completions only, got true"
    err = refusal("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    assert (err.field, err.message) == ("top_logprobs", "top_logprobs needs logprobs true, got top_logprobs 2 without it")
    assert not chat(echo=False).echo


def test_logprobs_in_each_form() -> None:
    plain = completion(logprobs=0)
    assert (plain.logprobs, plain.alternatives, plain.message.top_logprobs) == (True, 0, 1)
    five = completion(logprobs=5, echo=True)
    assert (five.alternatives, five.message.top_logprobs, five.message.echo_prompt_logprobs, five.echo) == (5, 5, True, True)
    assert not completion(echo=True).message.echo_prompt_logprobs  # echo without logprobs: text only
    c = chat(logprobs=True, top_logprobs=3)
    assert (c.logprobs, c.alternatives, c.message.top_logprobs) == (True, 3, 3)
    c0 = chat(logprobs=True)
    assert (c0.logprobs, c0.alternatives, c0.message.top_logprobs) == (True, 0, 1)
    off = chat(logprobs=False, top_logprobs=0)
    assert (off.logprobs, off.message.top_logprobs) == (False, 0)


def test_streaming_options() -> None:
    call = completion(stream=True, stream_options={"include_usage": True})
    assert call.stream and call.include_usage
    assert not completion(stream=True, stream_options={}).include_usage
    assert refusal("completions", {"prompt": "x", "stream_options": {"include_usage": True}}).message \
        == "stream_options needs stream true"
    assert refusal("completions", {"prompt": "x", "stream": True, "stream_options": [1]}).field == "stream_options"
    assert refusal("completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": "y"}}).field \
        == "stream_options.include_usage"


def test_response_formats() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    msg = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).message
    assert json.loads(msg.response_format.json_schema) == schema
    assert chat(response_format={"type": "json_object"}).message.response_format.json_schema == '{"type": "object"}'
    assert not chat(response_format={"type": "text"}).message.HasField("response_format")
    for bad, field in [({"type": "yaml"}, "response_format.type"), ("json", "response_format"),
                       ({"type": "json_schema"}, "response_format.json_schema"),
                       ({"type": "json_schema", "json_schema": {"schema": "s"}}, "response_format.json_schema.schema")]:
        assert refusal("chat", {"messages": [{"role": "user", "content": "x"}], "response_format": bad}).field == field


def test_the_body_must_be_an_object() -> None:
    err = refusal("completions", [1])
    assert (err.field, err.message) == ("body", "body must be a JSON object, got an array")


class Words:
    vocab_size = 100

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * len(text.split())


LIMITS = Limits(vocab_size=100, max_context_tokens=50, max_new_tokens_limit=20)


def engine_refusal(call: OpenAICall) -> InvalidField | ContextLengthExceeded:
    with pytest.raises((InvalidField, ContextLengthExceeded)) as caught:
        Request.parse(call.message, LIMITS, Words(), None)
    return call.rename(caught.value)  # type: ignore[return-value]


def test_the_engines_refusals_carry_the_bodys_names() -> None:
    err = engine_refusal(completion(max_tokens=30))
    assert (err.field, err.message, err.metadata["field"]) == ("max_tokens", "max_tokens must be 1..20, got 30", "max_tokens")
    err = engine_refusal(chat(max_completion_tokens=30))
    assert (err.field, err.message) == ("max_completion_tokens", "max_completion_tokens must be 1..20, got 30")
    err = engine_refusal(completion(temperature=200))
    assert (err.field, err.message) == ("temperature", "temperature must be finite and in [0, 100], got 200.0")
    err = engine_refusal(completion(max_tokens=5, min_tokens=6))
    assert (err.field, err.message) == ("min_tokens", "min_tokens must be at most max_tokens 5, got 6")
    err = engine_refusal(completion(prompt=[1, 200]))
    assert (err.field, err.message) == ("prompt", "prompt[1] must be < vocab_size 100, got 200")
    err = engine_refusal(completion(logprobs=21))
    assert (err.field, err.message) == ("logprobs", "logprobs must be 0..20, got 21")
    err = engine_refusal(chat(max_tokens=5, logprobs=True, top_logprobs=21))
    assert (err.field, err.message) == ("top_logprobs", "top_logprobs must be 0..20, got 21")
    err = engine_refusal(completion(stop=["x"] * 9))
    assert (err.field, err.message) == ("stop", "stop must hold at most 8 strings, got 9")
    err = engine_refusal(completion(prompt=""))
    assert (err.field, err.message) == ("prompt", "prompt must not be empty, got ''")
    err = parse_body({"messages": [{"role": "", "content": "x"}], "max_tokens": 3}, "chat", "", MODEL)
    with pytest.raises(InvalidField) as caught:
        Request.parse(err.message, LIMITS, Words(), None, _Template())
    renamed = err.rename(caught.value)
    assert (renamed.field, renamed.message) == ("messages[0].role", "messages[0].role must be not be empty, got ''"
                                                .replace("must be not be", "must not be"))
    err = engine_refusal(parse_body({"prompt": "x", "max_tokens": 3}, "completions", "bad id!", MODEL))
    assert err.field == "X-Request-Id"
    context = engine_refusal(completion(prompt="a " * 45, max_tokens=10))
    assert isinstance(context, ContextLengthExceeded) and context.field is None  # no field: left as it is
    queue = QueueFull.build(1, 1, 0.5)
    assert completion().rename(queue) is queue


class _Template:
    def render(self, messages):  # type: ignore[no-untyped-def]
        return " ".join(m.content for m in messages)
