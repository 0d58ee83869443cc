"""openai_request.parse_body: each OpenAI field into the DecodeRequest, each wrong type refused by
the body's name, and OpenAICall.rename giving the engine's refusals the body's names (pure, fast)."""

from __future__ import annotations

import json
import re

import pytest

from engine_service.requests import Limits, Request
from engine_service.transport.openai_request import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    OpenAICall,
    _kind,
    parse_body,
)
from shared.errors import ContextLengthExceeded, InvalidField, InvalidRequest, QueueFull

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


# -- each refusal in full: the field, the value the metadata carries, the message -------------------

USER = [{"role": "user", "content": "x"}]
LONG = "y" * 100  # past the 80 characters a message shows and the 64 the metadata keeps
CUT = "y" * 61 + "..."  # the metadata's form of a long value (shared.errors._short)


def said(endpoint: str, body: object) -> tuple[str | None, str, str]:
    err = refusal(endpoint, body)
    assert err.metadata["field"] == err.field and err.reason == "INVALID_FIELD"
    return err.field, err.metadata["value"], err.message


@pytest.mark.parametrize(("body", "field", "value", "message"), [
    ({}, "messages", "None", "messages must be given: an array of {role, content}"),
    ({"messages": {"role": "user"}}, "messages", "an object", "messages must be an array of {role, content}, got an object"),
    ({"messages": "hi"}, "messages", '"hi"', 'messages must be an array of {role, content}, got a string "hi"'),
    ({"messages": ["hi"]}, "messages[0]", '"hi"', 'messages[0] must be an object with role and content, got a string "hi"'),
    ({"messages": [None]}, "messages[0]", "null", "messages[0] must be an object with role and content, got null"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "null", "messages[0].role must be a string, got null"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "3",
     "messages[0].content must be a string or an array of text parts, got an integer 3"),
    ({"messages": [{"role": "user", "content": {"type": "text"}}]}, "messages[0].content", "an object",
     "messages[0].content must be a string or an array of text parts, got an object"),
    ({"messages": [USER[0], {"role": "user", "content": "a\ud800"}]}, "messages[1].content", "'a\\ud800'",
     "messages[1].content must be valid Unicode, got a lone surrogate at character 1"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]", "a string",
     "messages[0].content[0] must be a text part ({\"type\": \"text\", \"text\": ...}; this model reads text only), "
     "got 'a string'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, 5]}]}, "messages[0].content[1]",
     "an integer", "messages[0].content[1] must be a text part ({\"type\": \"text\", \"text\": ...}; this model reads "
     "text only), got 'an integer'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]", "image_url",
     "messages[0].content[0] must be a text part ({\"type\": \"text\", \"text\": ...}; this model reads text only), "
     "got 'image_url'"),
    ({"messages": [{"role": "user", "content": [{"type": LONG}]}]}, "messages[0].content[0]", CUT,
     "messages[0].content[0] must be a text part ({\"type\": \"text\", \"text\": ...}; this model reads text only), "
     f"got {'y' * 80!r}"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text", "null",
     "messages[0].content[0].text must be a string, got null"),
    ({"messages": USER, "echo": "yes"}, "echo", '"yes"', 'echo is served on /v1/completions only, got "yes"'),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs", "2",
     "top_logprobs needs logprobs true, got top_logprobs 2 without it"),
    ({"messages": USER, "response_format": "json"}, "response_format", '"json"',
     'response_format must be an object with a type, got a string "json"'),
    ({"messages": USER, "response_format": ["json"]}, "response_format", "an array",
     "response_format must be an object with a type, got an array"),
    ({"messages": USER, "response_format": {"type": "yaml"}}, "response_format.type", "yaml",
     "response_format.type must be text, json_object or json_schema, got 'yaml'"),
    ({"messages": USER, "response_format": {"type": LONG}}, "response_format.type", CUT,
     f"response_format.type must be text, json_object or json_schema, got {'y' * 80!r}"),
    ({"messages": USER, "response_format": {}}, "response_format.type", "None",
     "response_format.type must be text, json_object or json_schema, got 'None'"),
    ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format.json_schema", "null",
     "response_format.json_schema must be an object with a schema, got null"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": "s"}}, "response_format.json_schema",
     '"s"', 'response_format.json_schema must be an object with a schema, got a string "s"'),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format.json_schema.schema", "null", "response_format.json_schema.schema must be a JSON Schema (an object), "
     "got null"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": "s"}}},
     "response_format.json_schema.schema", '"s"',
     'response_format.json_schema.schema must be a JSON Schema (an object), got a string "s"'),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema", "an array",
     "response_format.json_schema.schema must be a JSON Schema (an object), got an array"),
])
def test_each_chat_refusal_in_full(body: dict, field: str, value: str, message: str) -> None:
    assert said("chat", body) == (field, value, message)


@pytest.mark.parametrize(("body", "field", "value", "message"), [
    ({}, "prompt", "None", "prompt must be given: a string or an array of token ids"),
    ({"prompt": []}, "prompt", "[]", "prompt must not be empty, got []"),
    ({"prompt": [[1], [2]]}, "prompt", "2 prompts",
     "prompt must be one prompt (several in one request are not served), got 2"),
    ({"prompt": {"text": "x"}}, "prompt", "an object", "prompt must be a string or an array of token ids, got an object"),
    ({"prompt": [1, None]}, "prompt[1]", "null", "prompt[1] must be a token id (an integer >= 0), got null"),
    ({"prompt": "x", "stop_token_ids": 5}, "stop_token_ids", "5",
     "stop_token_ids must be an array of token ids, got an integer 5"),
    ({"prompt": "x", "stop_token_ids": {"5": 1}}, "stop_token_ids", "an object",
     "stop_token_ids must be an array of token ids, got an object"),
    ({"prompt": "x", "stop_token_ids": [1, 2**32]}, "stop_token_ids[1]", "4294967296",
     "stop_token_ids[1] must be a token id (an integer >= 0), got an integer 4294967296"),
    ({"prompt": "x", "stop": [None]}, "stop[0]", "null", "stop[0] must be a string, got null"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "an object",
     "stream_options needs stream true"),
    ({"prompt": "x", "stream": False, "stream_options": [1]}, "stream_options", "an array", "stream_options needs stream true"),
    ({"prompt": "x", "stream": True, "stream_options": [1]}, "stream_options", "an array",
     "stream_options must be an object, got an array"),
    ({"prompt": "x", "stream": True, "stream_options": "usage"}, "stream_options", '"usage"',
     'stream_options must be an object, got a string "usage"'),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage", "1",
     "stream_options.include_usage must be a boolean (true or false), got an integer 1"),
    ({"prompt": "x", "model": "other"}, "model", "other",
     "model must be 'smollm2' (the one this engine serves) or absent, got 'other'"),
    ({"prompt": "x", "model": LONG}, "model", CUT,
     f"model must be 'smollm2' (the one this engine serves) or absent, got {'y' * 80!r}"),
    ({"prompt": "x", "n": 2}, "n", "2", "n must be 1 (one choice per request is served), got 2"),
    ({"prompt": "x", "n": "1"}, "n", '"1"', 'n must be 1 (one choice per request is served), got "1"'),
    ({"prompt": "x", "suffix": LONG}, "suffix", '"' + "y" * 60 + "...",
     f'suffix is not served (no insertion), got "{"y" * 79}'),
    ({"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias", "-1", "logit_bias keys must be token ids, got '-1'"),
    ({"prompt": "x", "logit_bias": {LONG: 1}}, "logit_bias", CUT, f"logit_bias keys must be token ids, got {'y' * 80!r}"),
    ({"prompt": "x", "logit_bias": {"4294967296": 1}}, "logit_bias", "4294967296",
     "logit_bias keys must be token ids, got '4294967296'"),
    ({"prompt": "x", "logit_bias": {"1": None}}, "logit_bias[1]", "null", "logit_bias[1] must be a number, got null"),
    ({"prompt": "x", "top_p": 0}, "top_p", "0.0", "top_p must be in (0, 1], got 0.0"),
    ({"prompt": "x", "repetition_penalty": 0.0}, "repetition_penalty", "0.0", "repetition_penalty must be in (0, 10], got 0.0"),
    ({"prompt": "x", "max_tokens": 2**32}, "max_tokens", "4294967296",
     "max_tokens must be an integer in 0..4294967295, got 4294967296"),
    ({"prompt": "x", "max_completion_tokens": -1}, "max_completion_tokens", "-1",
     "max_completion_tokens must be an integer in 0..4294967295, got -1"),
    ({"prompt": "x", "max_tokens": 10**50}, "max_tokens", "an integer of 51 digits",
     "max_tokens must be an integer in 0..4294967295, got an integer of 51 digits"),
    ({"prompt": "x", "max_tokens": [16]}, "max_tokens", "an array", "max_tokens must be an integer, got an array"),
    ({"prompt": "x", "temperature": "h" * 100}, "temperature", '"' + "h" * 60 + "...",
     f'temperature must be a number, got a string "{"h" * 79}'),
    ({"prompt": "x", "temperature": None, "top_k": {}}, "top_k", "an object", "top_k must be an integer, got an object"),
    ({"prompt": "x", "ignore_eos": None, "stream": []}, "stream", "an array",
     "stream must be a boolean (true or false), got an array"),
])
def test_each_completions_refusal_in_full(body: dict, field: str, value: str, message: str) -> None:
    assert said("completions", body) == (field, value, message)


def test_the_body_refusal_in_full() -> None:
    assert said("completions", None) == ("body", "null", "body must be a JSON object, got null")
    assert said("chat", "hi") == ("body", '"hi"', 'body must be a JSON object, got a string "hi"')
    assert said("chat", []) == ("body", "an array", "body must be a JSON object, got an array")


@pytest.mark.parametrize(("value", "digits"), [(10**400, 401), (-(10**400), 401), (10**309, 310)])
def test_an_integer_past_a_doubles_range_is_refused_by_its_size(value: int, digits: int) -> None:
    words = f"must be a number a double holds (at most about 1.8e308), got an integer of {digits} digits"
    assert said("completions", {"prompt": "x", "temperature": value}) \
        == ("temperature", f"an integer of {digits} digits", f"temperature {words}")
    assert said("completions", {"prompt": "x", "logit_bias": {"7": value}}) \
        == ("logit_bias[7]", f"an integer of {digits} digits", f"logit_bias[7] {words}")
    assert completion(temperature=10**308).message.sampling.temperature == float("inf")  # a float32 field; in range


@pytest.mark.parametrize(("field", "value", "shown"), [
    ("max_tokens", 10**39, str(10**39)),  # 40 characters: shown as it is
    ("max_tokens", 10**40, "an integer of 41 digits"),  # 41: by its size
    ("seed", -(10**38), str(-(10**38))),  # 40 characters with the sign
    ("seed", -(10**39), "an integer of 40 digits"),  # 41 with the sign; the digits counted without it
])
def test_a_long_integer_is_shown_by_its_size_past_40_characters(field: str, value: int, shown: str) -> None:
    low, high = (0, 2**32 - 1) if field == "max_tokens" else (0, 2**64 - 1)
    assert said("completions", {"prompt": "x", field: value}) \
        == (field, shown if len(shown) <= 64 else shown[:61] + "...", f"{field} must be an integer in {low}..{high}, got {shown}")


@pytest.mark.parametrize(("text", "at", "context"), [
    ("abc\ud800defghijklmnopqrstuvwxyz", 3, "abc\ud800defghij"),  # fewer than 8 before it, 7 after
    ("abcdefghijkl\ud800mnopqrstuvwxyz", 12, "efghijkl\ud800mnopqrs"),  # 8 before it, 7 after
    ("\ud800", 0, "\ud800"),
])
def test_a_lone_surrogate_is_named_with_its_place_and_neighbours(text: str, at: int, context: str) -> None:
    assert said("completions", {"prompt": text}) \
        == ("prompt", ascii(context), f"prompt must be valid Unicode, got a lone surrogate at character {at}")
    assert said("completions", {"prompt": "x", "stop": ["ok", text]})[:2] == ("stop[1]", ascii(context))


def test_each_kind_of_value_is_named() -> None:
    assert [_kind(v) for v in ({}, [], "", True, None, 1, 1.5)] \
        == ["an object", "an array", "a string", "a boolean", "null", "an integer", "a number"]
    assert (_kind(b"x"), _kind((1,)), _kind(frozenset())) == ("bytes", "tuple", "frozenset")  # not from JSON: its type
    assert said("completions", {"prompt": (1, 2)}) == ("prompt", "[1, 2]",
                                                       "prompt must be a string or an array of token ids, got tuple [1, 2]")


def test_the_bounds_themselves_are_served() -> None:
    top = completion(max_tokens=2**32 - 1, seed=2**64 - 1, top_k=2**31 - 1, min_tokens=0, logprobs=2**32 - 1,
                     logit_bias={"4294967295": 1, "0": -1, "0000000001": 2}, stop_token_ids=[0, 2**32 - 1])
    msg = top.message
    assert (msg.max_new_tokens, msg.sampling.seed, msg.sampling.top_k, msg.sampling.min_new_tokens) \
        == (2**32 - 1, 2**64 - 1, 2**31 - 1, 0)
    assert dict(msg.sampling.logit_bias) == {4294967295: 1.0, 0: -1.0, 1: 2.0}
    assert list(msg.stop_token_ids) == [0, 2**32 - 1] and top.alternatives == 2**32 - 1
    assert completion(max_tokens=0).message.max_new_tokens == 0 and completion(seed=0).message.sampling.seed == 0
    assert list(completion(prompt=[0]).message.prompt_token_ids.ids) == [0]
    assert list(completion(stop_token_ids=[]).message.stop_token_ids) == []  # empty: no stop tokens, not refused
    assert list(completion(stop=[]).message.stop) == []


def test_a_random_seed_fits_in_63_bits() -> None:
    assert all(0 <= completion().message.sampling.seed < 2**63 for _ in range(200))
    assert len({completion().message.sampling.seed >> 55 for _ in range(200)}) > 100  # spread over the 63


def test_echo_is_read_on_completions_only() -> None:
    assert completion(echo=True).echo and not completion(echo=False).echo and not completion().echo
    assert not chat(echo=False).echo and not chat(echo=False, logprobs=True).message.echo_prompt_logprobs


# -- rename: the body's names back in an engine refusal --------------------------------------------

def test_rename_changes_qualified_names_only_where_they_stand_alone() -> None:
    call = completion()
    err = InvalidField("sampling.top_p", 2.0, "sampling.top_p must be in (0, 1]; xsampling.top_p, a.sampling.top_p, "
                                             "sampling.top_pp and sampling.top_p_x stay; (sampling.top_p) and "
                                             "sampling.top_p[0] and sampling.top_p.x change; max_new_tokens too")
    renamed = call.rename(err)
    assert renamed.message == ("top_p must be in (0, 1]; xsampling.top_p, a.sampling.top_p, sampling.top_pp and "
                               "sampling.top_p_x stay; (top_p) and top_p[0] and top_p.x change; max_tokens too")
    assert (renamed.field, renamed.metadata) == ("top_p", {"field": "top_p", "value": "2.0"})
    chat_err = InvalidField("chat", "", "chat must hold a message; a chat is not chat.messages")
    renamed = chat().rename(chat_err)  # "chat" alone is a word: only its qualified forms change in the text
    assert (renamed.field, renamed.message) == ("messages", "chat must hold a message; a chat is not messages")


@pytest.mark.parametrize(("endpoint", "field", "body_name"), [
    ("chat", "chat.messages[3].role", "messages[3].role"),
    ("chat", "chat.messages", "messages"),
    ("chat", "chat.x", "messages.x"),  # a part of the chat by "."
    ("chat", "chat[0]", "messages[0]"),
    ("chat", "chatter", "chatter"),  # not a part of "chat": left as it is
    ("chat", "prompt_token_ids.ids[2]", "messages[2]"),
    ("completions", "prompt_token_ids.ids[2]", "prompt[2]"),
    ("completions", "prompt_text", "prompt"),
    ("completions", "top_logprobs", "logprobs"),
    ("chat", "top_logprobs", "top_logprobs"),
    ("completions", "response_format.json_schema", "response_format"),
    ("completions", "response_format.regex", "response_format"),
    ("completions", "response_format.lark_grammar", "response_format.lark_grammar"),
    ("completions", "request_id", "X-Request-Id"),
    ("completions", "stop[3]", "stop[3]"),
])
def test_rename_each_field(endpoint: str, field: str, body_name: str) -> None:
    call = completion() if endpoint == "completions" else chat()
    assert call.rename(InvalidField(field, 1, f"{field} is bad")).field == body_name


def test_rename_keeps_the_rest_of_the_error() -> None:
    err = InvalidRequest("max_new_tokens is bad", field="max_new_tokens", retry_delay=2.5)
    err.http_status = 400
    renamed = completion(max_completion_tokens=4).rename(err)
    assert type(renamed) is InvalidRequest and (renamed.field, renamed.message) == ("max_completion_tokens",
                                                                                     "max_completion_tokens is bad")
    assert (renamed.retry_delay, renamed.http_status, renamed.metadata) == (2.5, 400, {})  # no "field" was in it: none added
    kept = InvalidRequest("stop is bad", metadata={"field": "stop", "other": "x"}, field="stop")
    assert completion().rename(kept).metadata == {"field": "stop", "other": "x"}


def test_no_name_rename_substitutes_stands_inside_another() -> None:
    """The order of rename's substitutions does not change its text (docs/mutation-survivors.toml says so for
    rename's sort): no qualified name stands alone inside another name or inside a replacement, but for a
    name replaced by itself. A new name that breaks this needs its order thought through."""
    for call in (completion(), completion(max_completion_tokens=3), chat(), chat(max_completion_tokens=3)):
        names = call.names
        for name in (n for n in names if "." in n or "_" in n):
            pattern = rf"(?<![\w.]){re.escape(name)}(?![\w])"
            assert [n for n in names if n != name and re.search(pattern, n)] == []
            assert [v for v in set(names.values()) if re.search(pattern, v) and not v == name == names[name]] == [], name
