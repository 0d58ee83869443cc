"""An OpenAI-compatible request body, checked and turned into the engine's DecodeRequest (pure).

The HTTP front (http_front.py) reads the JSON; this module checks each field it knows for its JSON
type (a wrongly typed one is INVALID_FIELD naming it, as vLLM's pydantic models refuse it), fills
the same `engine.v1.DecodeRequest` a gRPC caller sends, and leaves every bound to
`Request.parse`, so that both fronts refuse the same values with the same words. A field the
engine does not know is ignored, as vLLM and llama-server ignore it; one it knows and cannot serve
(`n` > 1, several prompts, `best_of`, `suffix`, `tools`, `echo` on chat) is refused by name.
`OpenAICall.rename` turns the engine's field names in a refusal back into the body's
(`sampling.temperature` -> `temperature`, `max_new_tokens` -> `max_tokens`, `chat.messages[2].role`
-> `messages[2].role`).

Defaults are OpenAI's where they differ from engine.v1's: `temperature` 1 (the engine's 0 is
greedy), a random `seed` per request (the engine's 0 is a seed), `max_tokens` 16 on
/v1/completions and on chat what the context leaves (up to the engine's --max-new-tokens), as
OpenAI and vLLM do.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from engine.v1 import engine_pb2 as pb
from engine_service.requests import MAX_REPETITION_PENALTY
from shared.errors import EngineError, InvalidField, _rebuild

Endpoint = Literal["completions", "chat"]
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
UINT32 = 2**32 - 1
UINT64 = 2**64 - 1
INT32 = 2**31 - 1
# Sampling fields whose 0 engine.v1 reads as "unset": a body's 0 is refused in Request.parse's words.
UNSET_AT_ZERO = {"top_p": "in (0, 1]", "repetition_penalty": f"in (0, {MAX_REPETITION_PENALTY:g}]"}
CONTENT_PART_TEXT = "text"

# engine.v1 field -> the body's, for names the two fronts spell differently (longest first in
# `rename`); the endpoint's own names (prompt or messages, logprobs or top_logprobs, max_tokens or
# max_completion_tokens) come from OpenAICall.
_COMMON_NAMES: Mapping[str, str] = {
    "sampling.temperature": "temperature", "sampling.top_p": "top_p", "sampling.top_k": "top_k",
    "sampling.repetition_penalty": "repetition_penalty", "sampling.presence_penalty": "presence_penalty",
    "sampling.frequency_penalty": "frequency_penalty", "sampling.min_p": "min_p",
    "sampling.min_new_tokens": "min_tokens", "sampling.logit_bias": "logit_bias", "request_id": "X-Request-Id",
    "response_format.json_schema": "response_format", "response_format.regex": "response_format",
}


@dataclass(frozen=True)
class OpenAICall:
    """One body, read: the DecodeRequest for `Request.parse`, and how to answer it."""

    endpoint: Endpoint
    message: pb.DecodeRequest
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    echo: bool  # completions: the prompt's text before the completion's (and its logprobs)
    logprobs: bool  # answer with log-probabilities
    alternatives: int  # most likely alternatives per token in them (top_logprobs)
    max_tokens_default: bool  # max_tokens was not given: chat takes what the context leaves
    max_tokens_name: str  # max_tokens or max_completion_tokens, as the body named it

    @property
    def names(self) -> Mapping[str, str]:
        prompt = "prompt" if self.endpoint == "completions" else "messages"
        return {**_COMMON_NAMES, "max_new_tokens": self.max_tokens_name, "prompt_text": prompt,
                "prompt_token_ids.ids": prompt, "chat.messages": "messages", "chat": "messages",
                "top_logprobs": "logprobs" if self.endpoint == "completions" else "top_logprobs"}

    def rename(self, err: EngineError) -> EngineError:
        """`err` with the body's names for the engine's field in its `field`, `metadata` and message."""
        names = self.names
        if err.field is None:
            return err
        field = _renamed(err.field, names)
        message = err.message
        for engine_name in sorted(names, key=len, reverse=True):
            if "." in engine_name or "_" in engine_name:  # qualified names only: "chat" is also a word
                message = re.sub(rf"(?<![\w.]){re.escape(engine_name)}(?![\w])", names[engine_name], message)
        metadata = {**err.metadata, "field": field} if "field" in err.metadata else err.metadata
        renamed = _rebuild(type(err), message, metadata, err.retry_delay, field, err.http_status)
        return renamed


def _renamed(field: str, names: Mapping[str, str]) -> str:
    for engine_name in sorted(names, key=len, reverse=True):
        if field == engine_name or field.startswith((engine_name + "[", engine_name + ".")):
            return names[engine_name] + field[len(engine_name):]
    return field


# -- the body's JSON types ---------------------------------------------------------------------------

def _kind(value: object) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _wrong(name: str, value: object, expected: str) -> InvalidField:
    if value is None or isinstance(value, (dict, list)):  # its kind says enough (null; megabytes of text)
        return InvalidField(name, _kind(value), f"{name} must be {expected}, got {_kind(value)}")
    shown = json.dumps(value)[:80]
    return InvalidField(name, shown, f"{name} must be {expected}, got {_kind(value)} {shown}")


def _shown(value: int) -> str:
    """An integer for a message: itself, or its size when it is long (a 400-digit one, say)."""
    text = str(value)
    return text if len(text) <= 40 else f"an integer of {len(text.lstrip('-'))} digits"


def _int(body: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():  # 16.0: pydantic's int accepts it too
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _wrong(name, value, "an integer")
    if not low <= value <= high:
        raise InvalidField(name, _shown(value), f"{name} must be an integer in {low}..{high}, got {_shown(value)}")
    return value


def _float(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    return None if value is None else _number(value, name)


def _number(value: object, name: str) -> float:
    """A JSON number as a float; an integer past the largest float (1e400 written without a point
    is an int to json.loads, not inf) is refused by name, not left to float()'s OverflowError."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _wrong(name, value, "a number")
    try:
        return float(value)
    except OverflowError:
        digits = len(str(abs(value)))
        raise InvalidField(name, f"an integer of {digits} digits",
                           f"{name} must be a number a double holds (at most about 1.8e308), got an integer "
                           f"of {digits} digits") from None


def _bool(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise _wrong(name, value, "a boolean (true or false)")
    return value


def json_text(value: object, name: str) -> str:
    """A JSON string that is UTF-8 (JSON's \\ud800 escapes can make one that is not)."""
    if not isinstance(value, str):
        raise _wrong(name, value, "a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidField(name, ascii(value[max(0, err.start - 8):err.start + 8]),
                           f"{name} must be valid Unicode, got a lone surrogate at character {err.start}") from None
    return value


def _refuse_unless(body: Mapping[str, Any], name: str, served: Callable[[Any], bool], why: str) -> None:
    value = body.get(name)
    if value is not None and not served(value):
        shown = json.dumps(value)[:80]
        raise InvalidField(name, shown, f"{name} {why}, got {shown}")


# -- the body --------------------------------------------------------------------------------------

def parse_body(body: object, endpoint: Endpoint, request_id: str, model: str) -> OpenAICall:
    """Check an OpenAI-compatible body of `endpoint` and fill the DecodeRequest (InvalidField naming
    the body's field). `request_id`: the X-Request-Id header's, or "" (the engine makes one);
    `model`: the served model's name (a body may name it, or no model)."""
    if not isinstance(body, dict):
        raise _wrong("body", body, "a JSON object")
    msg = pb.DecodeRequest(request_id=request_id)
    named = body.get("model")
    if named is not None and json_text(named, "model") != model:
        shown = named[:80]
        raise InvalidField("model", shown, f"model must be {model!r} (the one this engine serves) or absent, "
                                           f"got {shown!r}")
    _refuse_unless(body, "n", lambda v: v == 1, "must be 1 (one choice per request is served)")
    _refuse_unless(body, "best_of", lambda v: v == 1, "must be 1 (one choice per request is served)")
    _refuse_unless(body, "tools", lambda v: v == [], "are not served (no tool calling)")
    if endpoint == "completions":
        _refuse_unless(body, "suffix", lambda v: v == "", "is not served (no insertion)")
        _prompt(body.get("prompt"), msg)
    else:
        _messages(body.get("messages"), msg)
        _refuse_unless(body, "echo", lambda v: v is False, "is served on /v1/completions only")
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, max_name, 0, UINT32)
    if max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if endpoint == "completions" else 0  # 0: set by the front
    msg.max_new_tokens = max_tokens
    _sampling(body, msg.sampling)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list):
            raise _wrong("stop", stop, "a string or an array of strings")
        msg.stop.extend(json_text(s, f"stop[{i}]") for i, s in enumerate(stop))
    ids = body.get("stop_token_ids")  # vLLM's
    if ids is not None:
        msg.stop_token_ids.extend(_token_ids(ids, "stop_token_ids", allow_empty=True))
    msg.ignore_eos = bool(_bool(body, "ignore_eos"))
    logprobs, alternatives = _logprobs(body, endpoint)
    echo = bool(_bool(body, "echo"))  # chat's was refused above unless false
    if logprobs:
        msg.top_logprobs = max(1, alternatives)  # the engine's 0 is "none": the chosen token's alone drops the one
        msg.echo_prompt_logprobs = echo
    _response_format(body.get("response_format"), msg)
    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise InvalidField("stream_options", _kind(options), "stream_options needs stream true")
        if not isinstance(options, dict):
            raise _wrong("stream_options", options, "an object")
        include_usage = bool(_bool({"stream_options.include_usage": options.get("include_usage")},
                                   "stream_options.include_usage"))
    return OpenAICall(endpoint=endpoint, message=msg, stream=stream, include_usage=include_usage, echo=echo,
                      logprobs=logprobs, alternatives=alternatives, max_tokens_default=body.get(max_name) is None,
                      max_tokens_name=max_name)


def _prompt(prompt: object, msg: pb.DecodeRequest) -> None:
    """A string, an array of token ids, or an array of one of either; several prompts are refused."""
    if prompt is None:
        raise InvalidField("prompt", None, "prompt must be given: a string or an array of token ids")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidField("prompt", f"{len(prompt)} prompts",
                               f"prompt must be one prompt (several in one request are not served), got {len(prompt)}")
        prompt = prompt[0]
    if isinstance(prompt, str):
        msg.prompt_text = json_text(prompt, "prompt")
        return
    if not isinstance(prompt, list):
        raise _wrong("prompt", prompt, "a string or an array of token ids")
    msg.prompt_token_ids.ids.extend(_token_ids(prompt, "prompt", allow_empty=False))


def _token_ids(ids: object, name: str, *, allow_empty: bool) -> list[int]:
    if not isinstance(ids, list):
        raise _wrong(name, ids, "an array of token ids")
    if not ids and not allow_empty:
        raise InvalidField(name, [], f"{name} must not be empty, got []")
    for i, token in enumerate(ids):
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= UINT32:
            raise _wrong(f"{name}[{i}]", token, "a token id (an integer >= 0)")
    return ids  # type: ignore[return-value]


def _messages(messages: object, msg: pb.DecodeRequest) -> None:
    if messages is None:
        raise InvalidField("messages", None, "messages must be given: an array of {role, content}")
    if not isinstance(messages, list):
        raise _wrong("messages", messages, "an array of {role, content}")
    chat = msg.chat
    chat.SetInParent()  # an empty array is still the chat prompt, refused by name in Request.parse
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _wrong(f"messages[{i}]", message, "an object with role and content")
        role = json_text(message.get("role"), f"messages[{i}].role")
        chat.messages.add(role=role, content=_content(message.get("content"), f"messages[{i}].content"))


def _content(content: object, name: str) -> str:
    """A string, null (an assistant turn without text), or an array of text parts, joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return json_text(content, name)
    if not isinstance(content, list):
        raise _wrong(name, content, "a string or an array of text parts")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != CONTENT_PART_TEXT:
            kind = str(part.get("type") if isinstance(part, dict) else _kind(part))[:80]
            raise InvalidField(f"{name}[{i}]", kind,
                               f"{name}[{i}] must be a text part ({{\"type\": \"text\", \"text\": ...}}; this model "
                               f"reads text only), got {kind!r}")
        texts.append(json_text(part.get("text"), f"{name}[{i}].text"))
    return "".join(texts)


def _sampling(body: Mapping[str, Any], sampling: pb.SamplingParams) -> None:
    temperature = _float(body, "temperature")
    sampling.temperature = 1.0 if temperature is None else temperature
    for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = _float(body, name)
        if value == 0.0 and name in UNSET_AT_ZERO:  # the engine's 0 is "unset"; the body's is a value, refused
            raise InvalidField(name, value, f"{name} must be {UNSET_AT_ZERO[name]}, got {value}")
        if value is not None:
            setattr(sampling, name, value)
    top_k = _int(body, "top_k", -1, INT32)
    if top_k is not None:
        sampling.top_k = max(top_k, 0)  # vLLM's -1 and the engine's 0 both mean every token
    seed = _int(body, "seed", 0, UINT64)
    sampling.seed = random.getrandbits(63) if seed is None else seed
    min_tokens = _int(body, "min_tokens", 0, UINT32)
    if min_tokens is not None:
        sampling.min_new_tokens = min_tokens
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise _wrong("logit_bias", bias, "an object of token id -> bias")
        for key, value in bias.items():
            if not re.fullmatch(r"[0-9]{1,10}", key) or int(key) > UINT32:
                shown = key[:80]
                raise InvalidField("logit_bias", shown, f"logit_bias keys must be token ids, got {shown!r}")
            sampling.logit_bias[int(key)] = _number(value, f"logit_bias[{key}]")


def _logprobs(body: Mapping[str, Any], endpoint: Endpoint) -> tuple[bool, int]:
    """(whether log-probabilities are asked, alternatives per token). Completions: `logprobs` an
    integer (alternatives; 0 for the chosen tokens' alone). Chat: `logprobs` true, `top_logprobs` N."""
    if endpoint == "completions":
        alternatives = _int(body, "logprobs", 0, UINT32)
        return alternatives is not None, alternatives or 0
    asked = bool(_bool(body, "logprobs"))
    top = _int(body, "top_logprobs", 0, UINT32)
    if top and not asked:
        raise InvalidField("top_logprobs", top, f"top_logprobs needs logprobs true, got top_logprobs {top} without it")
    return asked, top or 0


def _response_format(fmt: object, msg: pb.DecodeRequest) -> None:
    """`{"type": "json_schema", "json_schema": {"schema": {...}}}`, `{"type": "json_object"}` (any
    JSON object), or `{"type": "text"}` (no constraint)."""
    if fmt is None:
        return
    if not isinstance(fmt, dict):
        raise _wrong("response_format", fmt, "an object with a type")
    kind = fmt.get("type")
    if kind == "text":
        return
    if kind == "json_object":
        msg.response_format.json_schema = '{"type": "object"}'
        return
    if kind != "json_schema":
        shown = str(kind)[:80]
        raise InvalidField("response_format.type", shown,
                           f"response_format.type must be text, json_object or json_schema, got {shown!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise _wrong("response_format.json_schema", spec, "an object with a schema")
    schema = spec.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise _wrong("response_format.json_schema.schema", schema, "a JSON Schema (an object)")
    msg.response_format.json_schema = json.dumps(schema)
