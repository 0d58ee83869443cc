"""The error table's HTTP column (shared/errors.py): each exception's status, its body in vLLM's
shape with the ErrorInfo reason as `type`, the context sentence every OpenAI-compatible client
reads, and the headers (pure, fast)."""

from __future__ import annotations

import pytest

from bench_client.openai_errors import from_http_response
from shared.errors import (
    BadRequest,
    Cancelled,
    ClientTimeout,
    ContextLengthExceeded,
    DeadlineExceeded,
    EngineDraining,
    EngineUnavailable,
    InternalError,
    InvalidField,
    PermissionDenied,
    QueueFull,
    RequestTooLarge,
    SequenceError,
    StreamError,
    TransportError,
    Unauthenticated,
    http_message,
    to_http_error,
)


@pytest.mark.parametrize(("err", "status"), [
    (InvalidField("max_new_tokens", 0, "max_new_tokens must be 1..8, got 0"), 400),
    (ContextLengthExceeded.build(10, 5, 12), 400),
    (BadRequest("no"), 400),
    (QueueFull.build(3, 3, 0.5), 429),
    (SequenceError.build("r", 2, "boom"), 500),
    (EngineDraining.build(30), 503),
    (DeadlineExceeded.build("r", 1), 408),
    (Unauthenticated("missing bearer token for /v1/completions"), 401),
    (InternalError.build("r"), 500),
    (EngineUnavailable("engine stopped"), 503),
    (Cancelled("cancelled"), 499),
    (ClientTimeout("late"), 408),
    (PermissionDenied("no"), 403),
    (RequestTooLarge("body must be at most 10 bytes"), 413),
    (TransportError("odd"), 500),
    (StreamError("frame"), 500),
])
def test_each_exception_has_its_status_and_body(err, status: int) -> None:  # type: ignore[no-untyped-def]
    answer = to_http_error(err)
    assert answer.status == status
    body = answer.body["error"]  # type: ignore[index]
    assert body["code"] == status and body["type"] == (err.reason or type(err).__name__)
    assert body["message"] == http_message(err) and body["param"] == err.field and body["metadata"] == err.metadata


def test_the_field_and_the_param() -> None:
    err = InvalidField("sampling.top_p", 2.0, "sampling.top_p must be in (0, 1], got 2.0")
    assert to_http_error(err).body["error"]["param"] == "sampling.top_p"  # type: ignore[index]
    assert to_http_error(err, "top_p").body["error"]["param"] == "top_p"  # type: ignore[index]
    assert to_http_error(err).headers == {}


@pytest.mark.parametrize(("delay", "header"), [(0.5, "1"), (0.01, "1"), (1.0, "1"), (1.2, "2"), (30.0, "30")])
def test_retry_after_is_whole_seconds_rounded_up(delay: float, header: str) -> None:
    assert to_http_error(QueueFull.build(1, 1, delay)).headers == {"Retry-After": header}
    assert to_http_error(EngineDraining.build(10, delay)).headers == {"Retry-After": header}


def test_unauthenticated_names_the_scheme() -> None:
    assert to_http_error(Unauthenticated("missing")).headers == {"WWW-Authenticate": "Bearer"}


def test_a_context_too_long_says_it_as_vllm_does_and_our_client_reads_it() -> None:
    err = ContextLengthExceeded.build(2000, 100, 2048)
    message = http_message(err)
    assert message == ("This model's maximum context length is 2048 tokens. However, you requested 2100 tokens "
                       "(2000 in the messages, 100 in the completion). Please reduce the length of the messages or "
                       f"completion. ({err.message})")
    ours = from_http_response(400, {}, to_http_error(err).body)  # type: ignore[arg-type]
    assert isinstance(ours, ContextLengthExceeded)
    assert (ours.metadata["promptTokens"], ours.metadata["maxContextTokens"]) == ("2000", "2048")
    bare = ContextLengthExceeded("too long, no numbers")
    assert http_message(bare) == "too long, no numbers"
    odd = ContextLengthExceeded("x", metadata={"promptTokens": "many", "maxNewTokens": 1, "maxContextTokens": 2})
    assert http_message(odd) == "x"
    assert http_message(QueueFull.build(1, 1, 1.0)) == QueueFull.build(1, 1, 1.0).message
