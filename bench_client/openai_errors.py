"""An OpenAI-compatible server's failures as the domain exceptions of `shared.errors` (pure, no I/O).

The HTTP adapter (bench_client/openai_http.py) hands every non-200 answer, every error frame of a
200 event stream and every transport failure to this module, which classifies it on the status
*and* the body (its `type`, and the wording of its message), never on the status alone: a 400 is
a skip of the point only when it says what it refused. Every exception it returns carries
`http_status` (the HTTP status, or the error frame's code), and `status_code` (a grpc.StatusCode)
where its class's own code would misstate it, so that `shared.errors.wire_code` reads "HTTP_429"
and `bench_client.policy` decides on the class (or, for TransportError, on the code).

This engine's own HTTP front (engine_service/transport/http_front.py) answers with the body of
`shared.errors.to_http_error`: `{"error": {"message", "type", "param", "code", "metadata"}}`, the
ErrorInfo reason as `type` and its metadata as `metadata`. A non-200 answer or an error frame of
that shape whose `type` is one of engine.v1's reasons and whose status (a frame's `code`) is that
reason's HTTP status is read back first, by `shared.errors.from_http_error`: the reason's class,
with the metadata as sent (no httpStatus or errorType added: the same as over gRPC), so that each
reason is decided as it is over gRPC, whichever front served it:

| HTTP | `type`                  | exception                                   | policy: before / after the first token |
|------|-------------------------|---------------------------------------------|----------------------------------------|
| 400  | INVALID_FIELD           | InvalidField (`param` its field)            | SKIP_POINT / COUNT_FAILED              |
| 400  | CONTEXT_LENGTH_EXCEEDED | ContextLengthExceeded (numbers: `metadata`, | SKIP_POINT / COUNT_FAILED              |
|      |                         | else the message's)                         |                                        |
| 401  | UNAUTHENTICATED         | Unauthenticated                             | STOP_SWEEP                             |
| 408  | DEADLINE_EXCEEDED       | DeadlineExceeded                            | COUNT_FAILED                           |
| 429  | QUEUE_FULL              | QueueFull (Retry-After)                     | RETRY_AFTER_BACKOFF / COUNT_FAILED     |
| 500  | SEQUENCE_ABORTED        | SequenceError                               | COUNT_FAILED                           |
| 500  | INTERNAL                | InternalError                               | COUNT_FAILED                           |
| 503  | ENGINE_DRAINING         | EngineDraining (Retry-After)                | WAIT_FOR_HEALTH_THEN_RETRY / COUNT_FAILED |
| 503  | EngineUnavailable       | EngineUnavailable (a fatal engine error)    | WAIT_FOR_HEALTH_THEN_RETRY / COUNT_FAILED |
| 499  | Cancelled               | Cancelled                                   | WAIT_FOR_HEALTH_THEN_RETRY / COUNT_FAILED |
| 413  | RequestTooLarge         | RequestTooLarge (RESOURCE_EXHAUSTED)        | SKIP_POINT / COUNT_FAILED              |

(The last three are the classes the engine sends without a reason, by their name.) Any other body
is another server's, classified by this table:

| HTTP status                      | exception               | status_code_of       | policy, before the first token |
|----------------------------------|-------------------------|----------------------|--------------------------------|
| 400, 413, 422: a context wording | ContextLengthExceeded   | INVALID_ARGUMENT     | SKIP_POINT                     |
| 400, 413, 422: anything else     | BadRequest              | INVALID_ARGUMENT     | SKIP_POINT                     |
| 401                              | Unauthenticated         | UNAUTHENTICATED      | STOP_SWEEP                     |
| 403                              | PermissionDenied        | PERMISSION_DENIED    | STOP_SWEEP                     |
| 404, 405, 501                    | TransportError          | UNIMPLEMENTED        | STOP_SWEEP                     |
| 408, 504                         | TransportError          | DEADLINE_EXCEEDED    | COUNT_FAILED                   |
| 409                              | TransportError          | ABORTED              | COUNT_FAILED                   |
| 429                              | QueueFull (Retry-After) | RESOURCE_EXHAUSTED   | RETRY_AFTER_BACKOFF            |
| 503 (llama-server: loading)      | QueueFull (Retry-After) | UNAVAILABLE          | RETRY_AFTER_BACKOFF            |
| 424 (TGI: generation failed)     | TransportError          | INTERNAL             | COUNT_FAILED                   |
| 500                              | TransportError          | INTERNAL             | COUNT_FAILED                   |
| 502                              | TransportError          | UNAVAILABLE          | WAIT_FOR_HEALTH_THEN_RETRY     |
| any other 4xx                    | TransportError          | FAILED_PRECONDITION  | COUNT_FAILED                   |
| any other status                 | TransportError          | UNKNOWN              | COUNT_FAILED                   |
| error frame in a 200 stream      | StreamError             | its code, as above   | COUNT_FAILED                   |
| TGI's refusal as a first frame   | as for its 422 / 429    | as for 422 / 429     | SKIP_POINT / RETRY_AFTER_BACKOFF |
| refused, reset, cut              | EngineUnavailable       | UNAVAILABLE          | WAIT_FOR_HEALTH_THEN_RETRY     |

A StreamError's http_status is the frame's code (None when it has none); EngineUnavailable has none.
An error frame of this engine is its reason's class (SEQUENCE_ABORTED: SequenceError), not StreamError.
A mid-stream failure is COUNT_FAILED whatever its class (STOP_SWEEP for credentials).

TGI refuses a streamed request inside its stream: a 200 answer whose first event is
`{"error": {"message": "Input validation error: `top_p` must be > 0.0 and < 1.0", "http_status_code":
422}}` (router/src/infer/mod.rs, `into_openai_event`: 422 whatever the error, so its wording tells
them apart), then `[DONE]`. `from_first_error_frame` classifies such a frame as TGI's status for the
same error outside a stream (router/src/server.rs: ValidationError 422, Overloaded 429), so that a
refused top_p or context skips the point as a 422 does.

The context wordings recognised (the numbers are read from them into `promptTokens`,
`maxContextTokens` and, where given, `maxNewTokens`):

- this engine: vLLM's first sentence below (shared.errors.http_message), and its own "prompt_tokens
  + max_new_tokens must be <= max_context_tokens M, got N + K = T";
- llama-server: `"type": "exceed_context_size_error"` (with `n_prompt_tokens`, `n_ctx`), or "request
  (N tokens) exceeds the available context size (M tokens)", "input (N tokens) is larger than the max
  context size (M tokens)";
- vLLM: "This model's maximum context length is M tokens. However, you requested T tokens (N in the
  messages, K in the completion)", "... your request has N input tokens", "'max_tokens' or
  'max_completion_tokens' is too large: K. This model's maximum context length is M tokens and your
  request has N input tokens", "The decoder prompt (length N) is longer than the maximum model length
  of M", "Input prompt (N tokens) is too long and exceeds limit of M";
- SGLang: "The input (N tokens) is longer than the model's context length (M tokens)", "Requested
  token count exceeds the model's maximum context length of M tokens. You requested a total of T
  tokens: N tokens from the input messages and K tokens for the completion";
- TGI: "`inputs` tokens + `max_new_tokens` must be <= M. Given: N `inputs` tokens and K
  `max_new_tokens`", "`inputs` must have less than M tokens. Given: N".

A body that is not JSON, or JSON of another shape, still classifies by its status: its message is
the body's text, cut to 500 characters.
"""

from __future__ import annotations

import datetime
import email.utils
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from shared.errors import (
    BadRequest,
    ClientTimeout,
    ContextLengthExceeded,
    EngineError,
    EngineUnavailable,
    PermissionDenied,
    QueueFull,
    StreamError,
    TransportError,
    Unauthenticated,
    from_http_error,
)

MESSAGE_LIMIT = 500
NOT_SERVED = frozenset({404, 405, 501})  # a route this server does not have
_C = grpc.StatusCode
_REFUSALS = frozenset({400, 413, 422})
_CODES: Mapping[int, grpc.StatusCode] = {
    400: _C.INVALID_ARGUMENT, 401: _C.UNAUTHENTICATED, 403: _C.PERMISSION_DENIED,
    404: _C.UNIMPLEMENTED, 405: _C.UNIMPLEMENTED, 501: _C.UNIMPLEMENTED,
    408: _C.DEADLINE_EXCEEDED, 504: _C.DEADLINE_EXCEEDED, 409: _C.ABORTED,
    413: _C.INVALID_ARGUMENT, 422: _C.INVALID_ARGUMENT, 429: _C.RESOURCE_EXHAUSTED,
    424: _C.INTERNAL, 500: _C.INTERNAL, 502: _C.UNAVAILABLE, 503: _C.UNAVAILABLE,
}

# Each names the numbers it reads: prompt (promptTokens), context (maxContextTokens), new (maxNewTokens).
_CONTEXT_WORDINGS: tuple[re.Pattern[str], ...] = tuple(re.compile(p, re.IGNORECASE) for p in (
    # this engine (shared.errors.ContextLengthExceeded.build; over HTTP vLLM's sentence comes first)
    r"prompt_tokens \+ max_new_tokens must be <= max_context_tokens (?P<context>\d+), got (?P<prompt>\d+) \+ "
    r"(?P<new>\d+)",
    # llama-server
    r"request \((?P<prompt>\d+) tokens\) exceeds the available context size \((?P<context>\d+) tokens\)",
    r"input \((?P<prompt>\d+) tokens\) is larger than the max context size \((?P<context>\d+) tokens\)",
    # vLLM
    r"maximum context length is (?P<context>\d+) tokens\. However, you requested (?P<total>\d+) tokens "
    r"\((?P<prompt>\d+) in the messages, (?P<new>\d+) in the completion\)",
    r"maximum context length is (?P<context>\d+) tokens\. However, you requested (?P<prompt>\d+) tokens in the "
    r"messages",
    r"maximum context length is (?P<context>\d+) tokens\. However, your request has (?P<prompt>\d+) input tokens",
    r"'max_(?:completion_)?tokens' (?:or 'max_completion_tokens' )?is too large: (?P<new>\d+)\. This model's "
    r"maximum context length is (?P<context>\d+) tokens and your request has (?P<prompt>\d+) input tokens",
    r"the (?:decoder |encoder )?prompt \(length (?P<prompt>\d+)\) is longer than the maximum model length of "
    r"(?P<context>\d+)",
    r"input prompt \((?P<prompt>\d+) tokens\) is too long and exceeds (?:the )?limit of (?P<context>\d+)",
    # SGLang
    r"the input \((?P<prompt>\d+) tokens\) is longer than the model's context length \((?P<context>\d+) tokens\)",
    r"requested token count exceeds the model's maximum context length of (?P<context>\d+) tokens\. You "
    r"requested a total of (?P<total>\d+) tokens: (?P<prompt>\d+) tokens from the input messages and "
    r"(?P<new>\d+) tokens for the completion",
    # TGI
    r"`inputs` tokens \+ `max_new_tokens` must be <= (?P<context>\d+)\. Given: (?P<prompt>\d+) `inputs` tokens "
    r"and (?P<new>\d+) `max_new_tokens`",
    r"`inputs` must have less than (?P<context>\d+) tokens\. Given: (?P<prompt>\d+)",
))
_CONTEXT_TYPES = frozenset({"exceed_context_size_error"})  # llama-server's own error type


@dataclass(frozen=True)
class ErrorBody:
    """What an error body says, whatever its server's shape."""

    message: str
    type: str | None = None
    code: int | None = None
    fields: Mapping[str, Any] | None = None  # the error object itself, when it is one


def read_error_body(body: bytes | str | Mapping[str, Any] | None) -> ErrorBody:
    """The message, type and code of an error body: `{"error": {"message", "type", "code"}}`
    (OpenAI, vLLM, llama-server, SGLang), `{"object": "error", "message", "type", "code"}` (vLLM
    before 0.6, SGLang), `{"error": "...", "error_type": "..."}` (TGI), `{"detail": ...}` (FastAPI),
    or any other text, as it is."""
    if isinstance(body, Mapping):
        parsed: Any = body
        text = _dump(body)
    else:
        text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else (body or "")
        try:
            parsed = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the decoder goes
            return ErrorBody(_cut(text.strip()) or "(empty body)")
    if not isinstance(parsed, Mapping):
        return ErrorBody(_cut(text.strip()) or "(empty body)")
    error = parsed.get("error")
    if isinstance(error, Mapping):
        return ErrorBody(_message(error.get("message"), error) or _cut(text), json_str(error.get("type")),
                         json_int(error.get("code")), error)
    if isinstance(error, str):  # TGI
        return ErrorBody(_cut(error), json_str(parsed.get("error_type")), json_int(parsed.get("code")), parsed)
    if "message" in parsed:  # {"object": "error", ...}
        return ErrorBody(_message(parsed.get("message"), parsed) or _cut(text), json_str(parsed.get("type")),
                         json_int(parsed.get("code")), parsed)
    if "detail" in parsed:  # FastAPI's own refusals
        return ErrorBody(_message(parsed.get("detail"), parsed) or _cut(text), None, None, parsed)
    return ErrorBody(_cut(text), None, None, parsed)


def from_http_response(status: int, headers: Mapping[str, str], body: bytes | str,
                       *, now: datetime.datetime | None = None) -> EngineError:
    """The domain exception for an answer with HTTP status `status` (not 200), as the table of this
    module's docstring says. `now` is the time a Retry-After date is measured from (default: now)."""
    info = read_error_body(body)
    ours = _engine_error(status, info, retry_after(headers, now=now))
    if ours is not None:
        return ours
    metadata: dict[str, object] = {"httpStatus": status}
    if info.type:
        metadata["errorType"] = info.type
    err: EngineError
    if status in _REFUSALS:
        context = context_numbers(info)
        if context is not None:
            err = ContextLengthExceeded(info.message, metadata={**metadata, **context})
        else:
            err = BadRequest(info.message, metadata=metadata)
    elif status == 401:
        err = Unauthenticated(info.message, metadata=metadata)
    elif status == 403:
        err = PermissionDenied(info.message, metadata=metadata)
    elif status in (429, 503):
        err = QueueFull(info.message, metadata=metadata, retry_delay=retry_after(headers, now=now))
        if status == 503:
            err.status_code = _C.UNAVAILABLE  # type: ignore[attr-defined]
    else:
        err = TransportError(info.message, metadata=metadata)
        err.status_code = code_for_status(status)  # type: ignore[attr-defined]
    err.http_status = status
    return err


def from_error_frame(payload: Mapping[str, Any]) -> EngineError:
    """The StreamError for an error frame inside a 200 event stream: `{"error": {...}}` (llama-server,
    vLLM, SGLang), `{"error": "...", "error_type": ...}` (TGI), or the error object itself. Its
    http_status is the frame's code when it has one (llama-server sends 500, for instance). This
    engine's frame is its reason's class instead (`_engine_error`: SEQUENCE_ABORTED, ENGINE_DRAINING...)."""
    info = read_error_body(payload)
    ours = _engine_error(info.code, info, None)
    if ours is not None:
        return ours
    metadata: dict[str, object] = {}
    if info.type:
        metadata["errorType"] = info.type
    if info.code is not None:
        metadata["httpStatus"] = info.code
    err = StreamError(info.message, metadata=metadata)
    err.http_status = info.code
    if info.code is not None:
        err.status_code = code_for_status(info.code)  # type: ignore[attr-defined]
    return err


# TGI's InferError kinds that decide otherwise than a failed stream, by `error_type` (its
# ErrorResponse) or by the wording its OpenAI-shaped frame carries, and their status outside a stream.
_TGI_FRAME_STATUS: Mapping[str, int] = {"validation": 422, "overloaded": 429}
_TGI_FRAME_WORDINGS: tuple[tuple[str, str], ...] = (("Input validation error: ", "validation"),
                                                     ("Model is overloaded", "overloaded"))


def from_first_error_frame(payload: Mapping[str, Any]) -> EngineError:
    """The exception for an error frame that came before any token of a 200 stream: TGI's refusals
    (`error_type` "validation" / "overloaded", or its OpenAI-shaped frame `{"error": {"message",
    "http_status_code"}}` worded "Input validation error: ..." / "Model is overloaded") as
    `from_http_response` gives them for TGI's status outside a stream (422, 429); any other frame is
    `from_error_frame`'s exception (this engine's reason's class, else StreamError)."""
    info = read_error_body(payload)
    kind = info.type if info.type in _TGI_FRAME_STATUS else None
    error = payload.get("error")
    if kind is None and isinstance(error, Mapping) and "http_status_code" in error:
        kind = next((k for prefix, k in _TGI_FRAME_WORDINGS if info.message.startswith(prefix)), None)
    if kind is None:
        return from_error_frame(payload)
    return from_http_response(_TGI_FRAME_STATUS[kind], {}, json.dumps({"error": info.message, "error_type": kind}))


def _engine_error(status: int | None, info: ErrorBody, retry_delay: float | None) -> EngineError | None:
    """This engine's answer (`type` one of its reasons, with that reason's status) as the reason's
    class, by `shared.errors.from_http_error`; None for any other server's. A context refusal whose
    metadata lacks a number gets it from the message (vLLM's sentence, or the engine's own)."""
    if info.type is None:
        return None
    fields = info.fields or {}
    sent = fields.get("metadata")
    metadata = {str(k): v if isinstance(v, str) else _dump(v) for k, v in sent.items()} \
        if isinstance(sent, Mapping) else {}
    err = from_http_error(status, info.type, info.message, metadata=metadata, field=json_str(fields.get("param")),
                          retry_delay=retry_delay)
    if isinstance(err, ContextLengthExceeded):
        for name, number in (context_numbers(info) or {}).items():
            err.metadata.setdefault(name, str(number))
    return err


def malformed_answer(url: str, body: bytes, why: str) -> TransportError:
    """A TransportError (UNKNOWN: the request failed, the point goes on) for a 200 answer that is
    not what the route answers (not JSON, another shape), naming the URL and the body (cut)."""
    text = body.decode("utf-8", errors="replace")
    err = TransportError(f"{url}: unreadable answer ({why}): {_cut(text, 200)!r}", metadata={"httpStatus": 200})
    err.http_status = 200
    err.status_code = _C.UNKNOWN  # type: ignore[attr-defined]
    return err


def malformed_event(data: str, why: str) -> StreamError:
    """A StreamError for an event of a 200 stream that could not be read (data not JSON, an
    unexpected shape), naming the data (cut)."""
    err = StreamError(f"malformed event in the answer stream ({why}): {_cut(data, 200)!r}",
                      metadata={"httpStatus": 200})
    err.http_status = 200
    return err


def transport_failure(url: str, cause: BaseException, *, during: str = "") -> EngineUnavailable:
    """EngineUnavailable for a connection refused, reset or cut, naming the URL and the OS error."""
    detail = str(cause) or type(cause).__name__
    os_error = getattr(cause, "os_error", cause)
    errno = getattr(os_error, "errno", None)
    if isinstance(os_error, OSError) and isinstance(errno, int) and errno > 0:
        detail = f"{os.strerror(errno)} (errno {errno}): {detail}"
    where = f" {during}" if during else ""
    return EngineUnavailable(f"{url}: connection failed{where}: {type(cause).__name__}: {detail}",
                             metadata={"url": url})


def client_timeout(url: str, timeout: float) -> ClientTimeout:
    """ClientTimeout for a call to `url` that had no complete answer within `timeout` seconds."""
    return ClientTimeout(f"{url}: no complete answer within the client's timeout of {timeout:g} s",
                         metadata={"url": url, "timeoutSeconds": f"{timeout:g}"})


def code_for_status(status: int) -> grpc.StatusCode:
    """The gRPC code of an HTTP status, as the table says."""
    if status in _CODES:
        return _CODES[status]
    if 400 <= status < 500:
        return _C.FAILED_PRECONDITION
    return _C.UNKNOWN


def context_numbers(info: ErrorBody) -> dict[str, int] | None:
    """The numbers of a refusal for the context length (`promptTokens`, `maxContextTokens`,
    `maxNewTokens`, as far as the body gives them), or None when the body is about something else."""
    numbers: dict[str, int] = {}
    fields = info.fields or {}
    if info.type in _CONTEXT_TYPES:
        for key, name in (("n_prompt_tokens", "promptTokens"), ("n_ctx", "maxContextTokens")):
            value = json_int(fields.get(key))
            if value is not None:
                numbers[name] = value
    for pattern in _CONTEXT_WORDINGS:
        match = pattern.search(info.message)
        if match is None:
            continue
        groups = match.groupdict()
        for group, name in (("prompt", "promptTokens"), ("context", "maxContextTokens"), ("new", "maxNewTokens")):
            if groups.get(group) is not None:
                numbers.setdefault(name, int(groups[group]))
        return numbers
    return numbers if info.type in _CONTEXT_TYPES else None


def retry_after(headers: Mapping[str, str], *, now: datetime.datetime | None = None) -> float | None:
    """Retry-After as seconds from now: delta-seconds, or an HTTP-date (never below 0); None when
    absent or unreadable."""
    value = _header(headers, "retry-after")
    if value is None:
        return None
    value = value.strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", value):
        seconds = float(value)
        return seconds if math.isfinite(seconds) else None  # hundreds of digits: no delay anyone meant
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    now = now or datetime.datetime.now(datetime.UTC)
    return max(0.0, (when - now).total_seconds())


def _header(headers: Mapping[str, str], name: str) -> str | None:
    for key, item in headers.items():
        if key.lower() == name:
            return item
    return None


def _message(value: Any, container: Mapping[str, Any]) -> str:
    if isinstance(value, str):
        return _cut(value)
    if isinstance(value, list):  # FastAPI: [{"loc": [...], "msg": "...", "type": "..."}]
        parts = [str(item.get("msg", item)) if isinstance(item, Mapping) else str(item) for item in value]
        return _cut("; ".join(parts))
    if value is None:
        return ""
    return _cut(_dump(value))


def _cut(text: str, limit: int = MESSAGE_LIMIT) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _dump(value: Any) -> str:
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return str(value)
    except RecursionError:  # nested deeper than the encoder goes (and repr would go)
        return f"(a {type(value).__name__} nested too deep to show)"


def json_str(value: Any) -> str | None:
    """A JSON field as a non-empty string, else None (the adapter reads the servers' bodies with it too)."""
    return value if isinstance(value, str) and value else None


def json_int(value: Any) -> int | None:
    """A JSON field as an integer: an int, a float with no fraction (400.0) or a decimal string ("429"),
    else None (a bool, another string, anything else)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.isdecimal() and len(value) <= 18:
        # not isdigit: "²".isdigit(), and int("²") fails; at most 18 digits: no count or code is longer,
        # and int() refuses a string of thousands
        return int(value)
    return None
