"""The domain exceptions and the one table that maps each to a gRPC status and google.rpc details,
and to an HTTP status and OpenAI-shaped error body.

Each exception class declares its status code, its HTTP status (`http_code`) and its ErrorInfo
reason, so the classes *are* the table (as in google-api-core): servers turn an exception into a
status with `to_status` (gRPC) or `to_http_error` (the engine's OpenAI-compatible HTTP front),
clients turn a `grpc.RpcError` back into the exception with `from_rpc_error`, and the HTTP front's
answer back with `from_http_error`. The bench client's HTTP adapter (bench_client/openai_errors.py)
is the other door in: it turns any OpenAI-compatible server's answer into the same classes (this
engine's by `from_http_error`, the others' by status and wording), with the HTTP status it came
with (`http_status`), so that one policy table decides for both protocols. The classes after
`Statuses that travel without our details` are the client's alone: no engine sends their reasons.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "engine.v1"
STATUS_DETAILS_KEY = "grpc-status-details-bin"


class EngineError(Exception):
    """Base of every error that crosses the wire. Subclasses declare `code` and `reason`."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN
    http_code: ClassVar[int] = 500  # the HTTP status the engine's HTTP front answers it with
    reason: ClassVar[str] = ""

    def __init__(
        self,
        message: str,
        *,
        metadata: Mapping[str, object] | None = None,
        retry_delay: float | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.metadata: dict[str, str] = {k: str(v) for k, v in (metadata or {}).items()}
        self.retry_delay = retry_delay
        self.field = field
        self.http_status: int | None = None  # the HTTP status it came with (None: over gRPC)

    def __reduce__(self):  # keep exceptions picklable despite keyword-only arguments
        return (_rebuild, (type(self), self.message, self.metadata, self.retry_delay, self.field, self.http_status))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, reason={self.reason!r}, metadata={self.metadata!r})"


def _rebuild(cls, message, metadata, retry_delay, field, http_status=None):  # type: ignore[no-untyped-def]
    """An instance of `cls` with these attributes, past its own __init__ (InvalidField's takes others)."""
    err = EngineError.__new__(cls)
    EngineError.__init__(err, message, metadata=metadata, retry_delay=retry_delay, field=field)
    err.http_status = http_status
    return err


class InvalidRequest(EngineError):
    """The request cannot be served as asked. Never retry it."""

    http_code = 400
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_FIELD"


class InvalidField(InvalidRequest):
    """One field is invalid; `field` names it (BadRequest.FieldViolation on the wire).

    The engine's fields (engine_service/requests.py, constraint.py; README's table gives each
    bound): request_id, max_new_tokens, sampling.temperature, sampling.top_p, sampling.top_k,
    sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty,
    sampling.min_p, sampling.min_new_tokens, sampling.logit_bias, stop_token_ids, stop, stop[i],
    top_logprobs, response_format, response_format.json_schema, response_format.regex,
    response_format.lark_grammar, prompt, prompt_text, prompt_token_ids.ids, chat, chat.messages,
    chat.messages[i].role, request (undecodable bytes); Tokenize's text for prompt_text.
    """

    reason = "INVALID_FIELD"

    def __init__(self, field: str, value: object, message: str) -> None:
        super().__init__(message, metadata={"field": field, "value": _short(value)}, field=field)


class ContextLengthExceeded(InvalidRequest):
    """Prompt tokens plus max_new_tokens exceed the engine's context."""

    reason = "CONTEXT_LENGTH_EXCEEDED"

    @classmethod
    def build(cls, prompt_tokens: int, max_new_tokens: int, max_context_tokens: int) -> ContextLengthExceeded:
        return cls(
            f"prompt_tokens + max_new_tokens must be <= max_context_tokens {max_context_tokens}, "
            f"got {prompt_tokens} + {max_new_tokens} = {prompt_tokens + max_new_tokens}",
            metadata={
                "promptTokens": prompt_tokens,
                "maxNewTokens": max_new_tokens,
                "maxContextTokens": max_context_tokens,
            },
        )


class QueueFull(EngineError):
    """The waiting queue is at capacity. Back off at least `retry_delay` seconds, then retry."""

    http_code = 429
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "QUEUE_FULL"

    @classmethod
    def build(cls, queue_depth: int, queue_capacity: int, retry_delay: float) -> QueueFull:
        return cls(
            f"waiting queue is full: {queue_depth} of {queue_capacity} places taken",
            metadata={"queueDepth": queue_depth, "queueCapacity": queue_capacity},
            retry_delay=retry_delay,
        )


class SequenceError(EngineError):
    """One sequence failed mid-decode; the engine aborts it alone."""

    http_code = 500
    code = grpc.StatusCode.ABORTED
    reason = "SEQUENCE_ABORTED"

    @classmethod
    def build(cls, request_id: str, generated_tokens: int, cause: str) -> SequenceError:
        return cls(
            f"sequence {request_id} aborted after {generated_tokens} generated tokens: {cause}",
            metadata={"requestId": request_id, "generatedTokens": generated_tokens, "cause": cause},
        )


class EngineDraining(EngineError):
    """The engine is shutting down and admits no new work."""

    http_code = 503
    code = grpc.StatusCode.UNAVAILABLE
    reason = "ENGINE_DRAINING"

    @classmethod
    def build(cls, grace_seconds: float, retry_delay: float = 1.0) -> EngineDraining:
        return cls(
            f"engine is draining (grace period {grace_seconds:g} s) and admits no new requests",
            metadata={"graceSeconds": f"{grace_seconds:g}"},
            retry_delay=retry_delay,
        )


class DeadlineExceeded(EngineError):
    """The request's deadline passed while it was queued or decoding."""

    http_code = 408
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_EXCEEDED"

    @classmethod
    def build(cls, request_id: str, generated_tokens: int) -> DeadlineExceeded:
        return cls(
            f"deadline of request {request_id} passed after {generated_tokens} generated tokens",
            metadata={"requestId": request_id, "generatedTokens": generated_tokens},
        )


class Unauthenticated(EngineError):
    """Missing or invalid credentials."""

    http_code = 401
    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


class InternalError(EngineError):
    """A bug in request handling. The message stays generic; the traceback is in the log."""

    http_code = 500
    code = grpc.StatusCode.INTERNAL
    reason = "INTERNAL"

    @classmethod
    def build(cls, request_id: str) -> InternalError:
        return cls(
            f"internal error while handling request {request_id}; see the engine log",
            metadata={"requestId": request_id},
        )


# Statuses that travel without our details.
class EngineUnavailable(EngineError):
    """UNAVAILABLE without ErrorInfo: the engine is down or unreachable. The engine itself sends
    it, without details, to the streams in flight when it stops on a fatal error."""

    http_code = 503
    code = grpc.StatusCode.UNAVAILABLE


class Cancelled(EngineError):
    """CANCELLED as a client receives it. grpc.aio raises asyncio.CancelledError, not this, for the
    caller's own cancellations; a received CANCELLED means the server's side cancelled the call
    (gRPC does so for calls it had accepted but not started when the server stops)."""

    http_code = 499
    code = grpc.StatusCode.CANCELLED


class TransportError(EngineError):
    """Any other status without our details (for example gRPC's own message-size limit)."""


class RequestTooLarge(TransportError):
    """A request larger than the server takes (--max-receive-bytes): HTTP 413, and over gRPC its own
    RESOURCE_EXHAUSTED, both without our details."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_code = 413


class ClientTimeout(EngineError):
    """The client's own timeout (policy.request_timeout_s) passed before the answer ended: the
    server said nothing, unlike the engine's DeadlineExceeded, which carries its ErrorInfo."""

    http_code = 408
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "CLIENT_TIMEOUT"


class PermissionDenied(EngineError):
    """The credentials were read but refused (HTTP 403; PERMISSION_DENIED): fix them."""

    http_code = 403
    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "PERMISSION_DENIED"


class BadRequest(InvalidRequest):
    """An HTTP server refused the request as malformed or unsupported (a 400 or 422 that is not
    about the context length); the message is the server's own. Never retry it."""

    reason = "BAD_REQUEST"


class StreamError(EngineError):
    """The server failed the request inside an answer that had begun well (an error frame in a
    200 event stream); `status_code` and `http_status` are the frame's code."""

    code = grpc.StatusCode.UNKNOWN
    reason = "STREAM_ERROR"


# The one table: ErrorInfo.reason -> exception class, for every reason the proto declares.
BY_REASON: Mapping[str, type[EngineError]] = {
    cls.reason: cls
    for cls in (InvalidField, ContextLengthExceeded, QueueFull, SequenceError, EngineDraining,
                DeadlineExceeded, Unauthenticated, InternalError)
}
# Statuses that arrive without details (from gRPC itself or the transport).
_BY_CODE_WITHOUT_DETAILS: Mapping[grpc.StatusCode, type[EngineError]] = {
    grpc.StatusCode.UNAVAILABLE: EngineUnavailable,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.DEADLINE_EXCEEDED: ClientTimeout,  # grpc's own deadline: the engine would have said
}


def _short(value: object, limit: int = 64) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _pack(message) -> any_pb2.Any:  # type: ignore[no-untyped-def]
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def to_status_proto(err: EngineError) -> status_pb2.Status:
    """The google.rpc.Status for an exception: ErrorInfo always, then the reason's extras."""
    details = [_pack(error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN, metadata=err.metadata))]
    if err.field is not None:
        violation = error_details_pb2.BadRequest.FieldViolation(field=err.field, description=err.message)
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
    if err.retry_delay is not None:
        delay = duration_pb2.Duration()
        delay.FromTimedelta(datetime.timedelta(seconds=err.retry_delay))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    return status_pb2.Status(code=err.code.value[0], message=err.message, details=details)


@dataclass(frozen=True)
class _PlainStatus(grpc.Status):
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, bytes], ...] = ()


def to_status(err: EngineError) -> grpc.Status:
    """A grpc.Status ready for `await context.abort(s.code, s.details, s.trailing_metadata)`."""
    if not err.reason:  # a transport-level failure: no details trailer at all, by contract
        return _PlainStatus(err.code, err.message)
    return rpc_status.to_status(to_status_proto(err))


def _status_from_trailers(trailing_metadata) -> status_pb2.Status | None:  # type: ignore[no-untyped-def]
    for key, value in trailing_metadata or ():
        if key == STATUS_DETAILS_KEY:
            return status_pb2.Status.FromString(value)
    return None


def from_rpc_error(err: grpc.RpcError) -> EngineError:
    """Turn a failed call (sync or aio) back into the domain exception, with its details."""
    code: grpc.StatusCode = err.code()  # type: ignore[attr-defined]
    message: str = err.details() or ""  # type: ignore[attr-defined]
    status = _status_from_trailers(err.trailing_metadata())  # type: ignore[attr-defined]
    info, field, retry_delay = None, None, None
    if status is not None:
        message = status.message
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
            elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                field = bad.field_violations[0].field if bad.field_violations else None
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                detail.Unpack(retry)
                retry_delay = retry.retry_delay.ToTimedelta().total_seconds()
    if info is not None and info.reason in BY_REASON:
        cls = BY_REASON[info.reason]
        metadata = dict(info.metadata)
    else:
        cls = _BY_CODE_WITHOUT_DETAILS.get(code, TransportError)
        metadata = {}
    result = _rebuild(cls, message, metadata, retry_delay, field)
    result.status_code = code  # the code actually received (TransportError may carry any)
    return result


def status_code_of(err: EngineError) -> grpc.StatusCode:
    """The status code an error travelled with (the class's own unless received otherwise)."""
    return getattr(err, "status_code", err.code)


def wire_code(err: EngineError) -> str:
    """The code as it travelled, for records and tables: "HTTP_429" over HTTP, else the gRPC name."""
    return f"HTTP_{err.http_status}" if err.http_status is not None else status_code_of(err).name



# -- the HTTP column -------------------------------------------------------------------------------

@dataclass(frozen=True)
class HttpError:
    """An exception as the engine's HTTP front sends it: status, JSON body, headers."""

    status: int
    body: Mapping[str, object]
    headers: Mapping[str, str]


def http_message(err: EngineError) -> str:
    """The message an HTTP body carries: the exception's own, and for a context that is too long
    vLLM's sentence before it, with the numbers, so that every OpenAI-compatible benchmark client
    (vLLM's, AIPerf, guidellm, ours: bench_client/openai_errors.py) reads it as "context too long"."""
    if isinstance(err, ContextLengthExceeded):
        try:
            prompt, new = int(err.metadata["promptTokens"]), int(err.metadata["maxNewTokens"])
            context = int(err.metadata["maxContextTokens"])
        except (KeyError, ValueError):  # built without the numbers: the message alone says it
            return err.message
        return (f"This model's maximum context length is {context} tokens. However, you requested "
                f"{prompt + new} tokens ({prompt} in the messages, {new} in the completion). "
                f"Please reduce the length of the messages or completion. ({err.message})")
    return err.message


def to_http_error(err: EngineError, param: str | None = None) -> HttpError:
    """The HTTP answer for an exception: its class's `http_code`; the body in vLLM's shape
    `{"error": {"message", "type", "param", "code"}}` with the ErrorInfo reason as `type` (the
    class name where it has none), the status as `code`, the field as `param` (`param` as the
    front names it, else the exception's `field`) and the ErrorInfo metadata as `metadata`;
    `Retry-After` (whole seconds, rounded up, as HTTP counts them) where it carries a retry delay,
    `WWW-Authenticate` for UNAUTHENTICATED."""
    status = err.http_code
    body = {"error": {"message": http_message(err), "type": err.reason or type(err).__name__,
                      "param": param if param is not None else err.field, "code": status,
                      "metadata": dict(err.metadata)}}
    headers: dict[str, str] = {}
    if err.retry_delay is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_delay)))
    if isinstance(err, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"
    return HttpError(status, body, headers)


# The `type` of the engine's HTTP bodies (to_http_error): the ErrorInfo reason, else the class name.
BY_HTTP_TYPE: Mapping[str, type[EngineError]] = {
    **BY_REASON, **{cls.__name__: cls for cls in (EngineUnavailable, Cancelled, RequestTooLarge)}}


def from_http_error(status: int | None, type_: str, message: str, *, metadata: Mapping[str, object],
                    field: str | None = None, retry_delay: float | None = None) -> EngineError | None:
    """The exception that an answer of the engine's HTTP front stands for, `to_http_error` read
    back: the class whose ErrorInfo reason is the body's `type` (or, for the three the engine sends
    without a reason, whose name is: EngineUnavailable, Cancelled, RequestTooLarge), where `status`
    (the HTTP status, or an error frame's `code`) is that class's `http_code`; with its `metadata`
    as sent, `param` as `field`, Retry-After as `retry_delay`, and `http_status` set. None for any
    other answer (another server's, or a known type with another status: a proxy's rewrite), which
    the caller classifies by its status and wording."""
    cls = BY_HTTP_TYPE.get(type_)
    if cls is None or status != cls.http_code:
        return None
    return _rebuild(cls, message, metadata, retry_delay, field, status)
