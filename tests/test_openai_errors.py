"""The OpenAI-compatible servers' failures, as each server words them, classified into the domain
exceptions, and what the one policy table does about each."""

from __future__ import annotations

import datetime
import email.utils
import json
import math

import grpc
import pytest

from bench_client.openai_errors import (
    NOT_SERVED,
    client_timeout,
    code_for_status,
    from_error_frame,
    from_first_error_frame,
    from_http_response,
    malformed_event,
    retry_after,
    transport_failure,
)
from bench_client.policy import Action, decide
from shared.errors import (
    BY_HTTP_TYPE,
    BY_REASON,
    BadRequest,
    Cancelled,
    ClientTimeout,
    ContextLengthExceeded,
    DeadlineExceeded,
    EngineDraining,
    EngineError,
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
    from_http_error,
    http_message,
    status_code_of,
    to_http_error,
    wire_code,
)

LLAMA_CONTEXT = {"error": {"code": 400, "type": "exceed_context_size_error",
                           "message": "request (5000 tokens) exceeds the available context size (4096 tokens), "
                                      "try increasing it", "n_prompt_tokens": 5000, "n_ctx": 4096}}
VLLM_MESSAGE = ("This model's maximum context length is 2048 tokens. However, you requested 2100 tokens (2000 in the "
                "messages, 100 in the completion). Please reduce the length of the messages or completion.")
VLLM_CONTEXT = {"error": {"message": VLLM_MESSAGE, "type": "BadRequestError", "param": None, "code": 400}}
VLLM_OLD_CONTEXT = {"object": "error", "message": VLLM_MESSAGE, "type": "BadRequestError", "param": None, "code": 400}
VLLM_NEW_MESSAGE = ("'max_tokens' or 'max_completion_tokens' is too large: 100. This model's maximum context length is "
                    "2048 tokens and your request has 2000 input tokens (100 > 2048 - 2000).")
SGLANG_MESSAGE = "The input (3000 tokens) is longer than the model's context length (2048 tokens)."
TGI_MESSAGE = ("Input validation error: `inputs` tokens + `max_new_tokens` must be <= 2048. Given: 2000 `inputs` "
               "tokens and 100 `max_new_tokens`")
TGI_CONTEXT = {"error": TGI_MESSAGE, "error_type": "validation"}


def http(status: int, body: object, headers: dict[str, str] | None = None) -> EngineError:
    raw = body if isinstance(body, str | bytes) else json.dumps(body)
    return from_http_response(status, headers or {}, raw)


@pytest.mark.parametrize(("status", "body", "message", "numbers"), [
    (400, LLAMA_CONTEXT, LLAMA_CONTEXT["error"]["message"], {"promptTokens": "5000", "maxContextTokens": "4096"}),
    (400, VLLM_CONTEXT, VLLM_MESSAGE, {"promptTokens": "2000", "maxContextTokens": "2048", "maxNewTokens": "100"}),
    (400, VLLM_OLD_CONTEXT, VLLM_MESSAGE, {"promptTokens": "2000", "maxContextTokens": "2048", "maxNewTokens": "100"}),
    (400, {"error": {"message": VLLM_NEW_MESSAGE, "type": "BadRequestError", "code": 400}}, VLLM_NEW_MESSAGE,
     {"promptTokens": "2000", "maxContextTokens": "2048", "maxNewTokens": "100"}),
    (400, {"object": "error", "message": SGLANG_MESSAGE, "type": "BadRequestError", "code": 400}, SGLANG_MESSAGE,
     {"promptTokens": "3000", "maxContextTokens": "2048"}),
    (400, {"error": {"message": SGLANG_MESSAGE}}, SGLANG_MESSAGE, {"promptTokens": "3000", "maxContextTokens": "2048"}),
    (422, TGI_CONTEXT, TGI_MESSAGE, {"promptTokens": "2000", "maxContextTokens": "2048", "maxNewTokens": "100"}),
], ids=["llama-server", "vllm", "vllm-old", "vllm-new", "sglang-object", "sglang-error", "tgi"])
def test_context_length_refusals(status: int, body: object, message: str, numbers: dict[str, str]) -> None:
    err = http(status, body)
    assert type(err) is ContextLengthExceeded
    assert err.message == message  # the server's own words
    assert err.http_status == status and err.metadata["httpStatus"] == str(status)
    assert {k: err.metadata[k] for k in numbers} == numbers
    assert "maxNewTokens" in err.metadata or "maxNewTokens" not in numbers
    assert status_code_of(err) is grpc.StatusCode.INVALID_ARGUMENT
    assert wire_code(err) == f"HTTP_{status}"
    assert decide(err, first_token_seen=False) is Action.SKIP_POINT


def test_llama_server_context_type_without_known_wording_still_counts() -> None:
    body = {"error": {"code": 400, "type": "exceed_context_size_error", "message": "too big", "n_prompt_tokens": 9,
                      "n_ctx": 8}}
    err = http(400, body)
    assert type(err) is ContextLengthExceeded
    assert err.metadata["errorType"] == "exceed_context_size_error"
    assert err.metadata["promptTokens"] == "9" and err.metadata["maxContextTokens"] == "8"


@pytest.mark.parametrize(("status", "body", "message"), [
    (400, {"error": {"message": "top_k must be -1 (disable), or at least 1, got 0.", "type": "BadRequestError",
                     "code": 400}}, "top_k must be -1 (disable), or at least 1, got 0."),
    (422, {"error": "Input validation error: `top_p` must be > 0.0 and < 1.0", "error_type": "validation"},
     "Input validation error: `top_p` must be > 0.0 and < 1.0"),
    (400, {"error": {"message": "the context of the request is invalid: 'prompt' tokens must be in the vocabulary",
                     "type": "invalid_request_error", "code": 400}},
     "the context of the request is invalid: 'prompt' tokens must be in the vocabulary"),
    (400, {"error": {"message": "maximum context length must be set in the config", "type": "BadRequestError"}},
     "maximum context length must be set in the config"),
    (413, "Request Entity Too Large", "Request Entity Too Large"),
    (422, {"detail": [{"loc": ["body", "max_tokens"], "msg": "Input should be a valid integer", "type": "int"}]},
     "Input should be a valid integer"),
], ids=["vllm-top-k", "tgi-validation", "context-word-unrelated", "context-length-unrelated", "413-text", "fastapi"])
def test_other_refusals_are_bad_requests_not_context_skips(status: int, body: object, message: str) -> None:
    err = http(status, body)
    assert type(err) is BadRequest
    assert err.message == message
    assert err.reason == "BAD_REQUEST" and err.http_status == status
    assert "promptTokens" not in err.metadata
    assert decide(err, first_token_seen=False) is Action.SKIP_POINT
    assert decide(err, first_token_seen=True) is Action.COUNT_FAILED


def test_error_type_is_kept() -> None:
    err = http(422, {"error": "Input validation error: `top_p` must be > 0.0", "error_type": "validation"})
    assert err.metadata == {"httpStatus": "422", "errorType": "validation"}


def test_a_context_wording_on_a_500_is_not_a_skip() -> None:
    err = http(500, {"error": {"message": VLLM_MESSAGE, "type": "InternalServerError", "code": 500}})
    assert type(err) is TransportError and status_code_of(err) is grpc.StatusCode.INTERNAL
    assert decide(err, first_token_seen=False) is Action.COUNT_FAILED


@pytest.mark.parametrize(("status", "cls", "action"), [
    (401, Unauthenticated, Action.STOP_SWEEP),
    (403, PermissionDenied, Action.STOP_SWEEP),
])
def test_credentials(status: int, cls: type[EngineError], action: Action) -> None:
    err = http(status, {"error": {"code": status, "message": "Invalid API Key", "type": "authentication_error"}})
    assert type(err) is cls and err.message == "Invalid API Key" and err.http_status == status
    assert decide(err, first_token_seen=False) is action and decide(err, first_token_seen=True) is action


def test_429_with_retry_after_seconds() -> None:
    err = http(429, {"error": "Model is overloaded", "error_type": "overloaded"}, {"Retry-After": "2"})
    assert type(err) is QueueFull and err.retry_delay == 2.0 and err.http_status == 429
    assert err.metadata["httpStatus"] == "429"
    assert status_code_of(err) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert decide(err, first_token_seen=False) is Action.RETRY_AFTER_BACKOFF


def test_503_loading_with_retry_after_date() -> None:
    now = datetime.datetime(2026, 12, 1, 12, 0, 0, tzinfo=datetime.UTC)
    later = email.utils.format_datetime(now + datetime.timedelta(seconds=7), usegmt=True)
    body = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    err = from_http_response(503, {"retry-after": later}, json.dumps(body), now=now)
    assert type(err) is QueueFull and err.retry_delay == 7.0 and err.message == "Loading model"
    assert err.metadata == {"httpStatus": "503", "errorType": "unavailable_error"}
    assert status_code_of(err) is grpc.StatusCode.UNAVAILABLE and wire_code(err) == "HTTP_503"
    assert decide(err, first_token_seen=False) is Action.RETRY_AFTER_BACKOFF


def test_503_without_retry_after() -> None:
    assert http(503, "Service Unavailable").retry_delay is None


def test_retry_after_forms() -> None:
    now = datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC)
    past = email.utils.format_datetime(now - datetime.timedelta(seconds=30), usegmt=True)
    assert retry_after({"Retry-After": "120"}) == 120.0
    assert retry_after({"Retry-After": "Tue, 01 Dec 2026 00:00:05 GMT"}, now=now) == 5.0
    assert retry_after({"Retry-After": past}, now=now) == 0.0
    assert retry_after({"Retry-After": "soon"}) is None
    assert retry_after({}) is None


@pytest.mark.parametrize(("status", "code", "action"), [
    (404, grpc.StatusCode.UNIMPLEMENTED, Action.STOP_SWEEP),
    (405, grpc.StatusCode.UNIMPLEMENTED, Action.STOP_SWEEP),
    (501, grpc.StatusCode.UNIMPLEMENTED, Action.STOP_SWEEP),
    (408, grpc.StatusCode.DEADLINE_EXCEEDED, Action.COUNT_FAILED),
    (504, grpc.StatusCode.DEADLINE_EXCEEDED, Action.COUNT_FAILED),
    (424, grpc.StatusCode.INTERNAL, Action.COUNT_FAILED),
    (500, grpc.StatusCode.INTERNAL, Action.COUNT_FAILED),
    (502, grpc.StatusCode.UNAVAILABLE, Action.WAIT_FOR_HEALTH_THEN_RETRY),
    (418, grpc.StatusCode.FAILED_PRECONDITION, Action.COUNT_FAILED),
    (599, grpc.StatusCode.UNKNOWN, Action.COUNT_FAILED),
])
def test_transport_statuses(status: int, code: grpc.StatusCode, action: Action) -> None:
    err = http(status, "<html>nope</html>")
    assert type(err) is TransportError
    assert status_code_of(err) is code and code_for_status(status) is code
    assert err.http_status == status and err.message == "<html>nope</html>"
    assert decide(err, first_token_seen=False) is action


def test_a_body_of_an_unexpected_shape_still_classifies() -> None:
    err = http(500, "x" * 2000)
    assert len(err.message) == 500 and err.message.endswith("...")
    assert http(500, "").message == "(empty body)"
    assert http(400, "[1, 2]").message == "[1, 2]"
    assert http(400, json.dumps({"weird": True})).message == '{"weird": true}'
    assert type(http(400, b"\xff\xfe not utf-8")) is BadRequest


def test_error_frame_is_a_stream_error() -> None:
    err = from_error_frame({"error": {"code": 500, "message": "failed to decode the batch", "type": "server_error"}})
    assert type(err) is StreamError
    assert err.message == "failed to decode the batch" and err.http_status == 500
    assert status_code_of(err) is grpc.StatusCode.INTERNAL and wire_code(err) == "HTTP_500"
    assert decide(err, first_token_seen=True) is Action.COUNT_FAILED
    assert decide(err, first_token_seen=False) is Action.COUNT_FAILED


def test_error_frames_of_other_shapes() -> None:
    tgi = from_error_frame({"error": "Request failed during generation: CUDA OOM", "error_type": "generation"})
    assert tgi.message == "Request failed during generation: CUDA OOM" and tgi.http_status is None
    assert tgi.metadata == {"errorType": "generation"} and status_code_of(tgi) is grpc.StatusCode.UNKNOWN
    bare = from_error_frame({"message": "boom", "code": 400, "type": "BadRequestError"})
    assert bare.http_status == 400 and status_code_of(bare) is grpc.StatusCode.INVALID_ARGUMENT
    assert type(bare) is StreamError  # never a skip: the answer had begun


def test_malformed_event_and_transport_failure() -> None:
    err = malformed_event("not json" * 100, "data is not JSON")
    assert type(err) is StreamError and err.http_status == 200 and "not json" in err.message
    assert len(err.message) < 300
    down = transport_failure("http://127.0.0.1:9/v1/completions", ConnectionRefusedError(111, "Connection refused"))
    assert type(down) is EngineUnavailable and down.http_status is None
    assert "http://127.0.0.1:9/v1/completions" in down.message and "Connection refused" in down.message
    assert decide(down, first_token_seen=False) is Action.WAIT_FOR_HEALTH_THEN_RETRY
    assert decide(down, first_token_seen=True) is Action.COUNT_FAILED


def test_client_timeout_names_the_url_and_the_timeout() -> None:
    err = client_timeout("http://127.0.0.1:9/v1/completions", 2.5)
    assert type(err) is ClientTimeout
    assert err.message == "http://127.0.0.1:9/v1/completions: no complete answer within the client's timeout of 2.5 s"
    assert err.metadata == {"url": "http://127.0.0.1:9/v1/completions", "timeoutSeconds": "2.5"}


def test_the_statuses_of_a_route_not_served() -> None:
    assert NOT_SERVED == {404, 405, 501}
    assert all(code_for_status(status) is grpc.StatusCode.UNIMPLEMENTED for status in NOT_SERVED)


# -- this engine's own HTTP front: shared.errors.to_http_error read back ---------------------------

OURS: list[EngineError] = [
    InvalidField("max_tokens", 9000, "max_tokens must be <= 4096, got 9000"),
    ContextLengthExceeded.build(300, 8, 256),
    QueueFull.build(4, 4, 0.5),
    SequenceError.build("r-1", 3, "injected sequence error at decode step 7"),
    EngineDraining.build(30.0),
    DeadlineExceeded.build("r-2", 5),
    Unauthenticated("missing bearer token for /v1/completions", metadata={"scheme": "Bearer"}),
    InternalError.build("r-3"),
    EngineUnavailable("the engine stopped on a fatal error"),
    Cancelled("the call was cancelled"),
    RequestTooLarge("body must be at most 4194304 bytes (--max-receive-bytes), got 5000000"),
]


@pytest.mark.parametrize("sent", OURS, ids=[type(e).__name__ for e in OURS])
def test_this_engines_answers_are_read_back_as_the_class_it_sent(sent: EngineError) -> None:
    answer = to_http_error(sent)
    got = from_http_response(answer.status, answer.headers, json.dumps(answer.body))
    assert type(got) is type(sent)
    assert got.message == http_message(sent)  # the front's words (vLLM's sentence first for the context)
    assert got.metadata == sent.metadata and got.field == sent.field  # as over gRPC: no httpStatus added
    assert got.http_status == answer.status == sent.http_code and wire_code(got) == f"HTTP_{sent.http_code}"
    assert status_code_of(got) is sent.code
    assert got.retry_delay == (math.ceil(sent.retry_delay) if sent.retry_delay is not None else None)
    for seen in (False, True):  # the one policy table decides as for the gRPC front's exception
        assert decide(got, first_token_seen=seen) is decide(sent, first_token_seen=seen)


@pytest.mark.parametrize("sent", OURS, ids=[type(e).__name__ for e in OURS])
def test_this_engines_error_frames_are_the_class_it_sent(sent: EngineError) -> None:
    got = from_error_frame(to_http_error(sent).body)
    assert type(got) is type(sent) and got.http_status == sent.http_code
    assert got.metadata == sent.metadata and got.retry_delay is None  # a frame has no headers
    assert decide(got, first_token_seen=True) is decide(sent, first_token_seen=True)


def test_engine_draining_and_sequence_aborted_are_no_longer_a_full_queue_or_a_stream_error() -> None:
    draining = http(503, to_http_error(EngineDraining.build(30.0)).body, {"Retry-After": "1"})
    assert type(draining) is EngineDraining and draining.retry_delay == 1.0
    assert draining.reason == "ENGINE_DRAINING" and status_code_of(draining) is grpc.StatusCode.UNAVAILABLE
    assert decide(draining, first_token_seen=False) is Action.WAIT_FOR_HEALTH_THEN_RETRY
    frame = from_first_error_frame(to_http_error(SequenceError.build("r", 1, "boom")).body)
    assert type(frame) is SequenceError and frame.reason == "SEQUENCE_ABORTED"
    assert frame.metadata == {"requestId": "r", "generatedTokens": "1", "cause": "boom"}


def test_this_engines_retry_after_may_be_a_date_measured_from_now() -> None:
    now = datetime.datetime(2026, 12, 1, 12, 0, 0, tzinfo=datetime.UTC)
    later = email.utils.format_datetime(now + datetime.timedelta(seconds=3), usegmt=True)
    err = from_http_response(429, {"Retry-After": later}, json.dumps(to_http_error(QueueFull.build(1, 1, 0.5)).body),
                             now=now)
    assert type(err) is QueueFull and err.retry_delay == 3.0


def test_a_reason_with_another_status_is_classified_by_the_status() -> None:
    # a proxy's rewrite, or another server that happens to use the word: the status decides
    rewritten = http(500, {"error": {"message": "draining", "type": "ENGINE_DRAINING", "code": 500}})
    assert type(rewritten) is TransportError and status_code_of(rewritten) is grpc.StatusCode.INTERNAL
    assert rewritten.metadata == {"httpStatus": "500", "errorType": "ENGINE_DRAINING"}
    assert type(http(422, {"error": {"message": "m", "type": "INVALID_FIELD", "code": 422}})) is BadRequest
    frame = from_error_frame({"error": {"message": "aborted", "type": "SEQUENCE_ABORTED"}})  # no code
    assert type(frame) is StreamError and frame.http_status is None
    assert type(http(429, {"error": {"message": "m", "type": "queue_full", "code": 429}})) is QueueFull
    assert http(429, {"error": {"message": "m", "type": "queue_full"}}).metadata["errorType"] == "queue_full"


def test_a_context_refusal_without_its_numbers_in_metadata_reads_them_from_the_message() -> None:
    ours = "prompt_tokens + max_new_tokens must be <= max_context_tokens 256, got 301 + 8 = 309"
    bare = http(400, {"error": {"message": ours, "type": "CONTEXT_LENGTH_EXCEEDED", "code": 400}})
    assert type(bare) is ContextLengthExceeded
    assert bare.metadata == {"promptTokens": "301", "maxNewTokens": "8", "maxContextTokens": "256"}
    vllm = http(400, {"error": {"message": VLLM_MESSAGE, "type": "CONTEXT_LENGTH_EXCEEDED", "code": 400,
                                "metadata": {"promptTokens": 1999}}})
    assert vllm.metadata == {"promptTokens": "1999", "maxContextTokens": "2048", "maxNewTokens": "100"}  # sent wins
    worded = http(400, {"error": {"message": f"refused: {ours}", "type": "BadRequestError", "code": 400}})
    assert type(worded) is ContextLengthExceeded and worded.metadata["promptTokens"] == "301"  # the wording alone


def test_this_engines_metadata_and_param_are_read_as_strings_whatever_json_sent() -> None:
    odd = http(400, {"error": {"message": "m", "type": "INVALID_FIELD", "code": 400, "param": "top_p",
                               "metadata": {"value": 1.5, "nested": {"a": [1]}, "field": "top_p"}}})
    assert type(odd) is InvalidField and odd.field == "top_p"
    assert odd.metadata == {"value": "1.5", "nested": '{"a": [1]}', "field": "top_p"}
    listed = http(400, {"error": {"message": "m", "type": "INVALID_FIELD", "code": 400, "param": 7,
                                  "metadata": ["not", "a", "mapping"]}})
    assert type(listed) is InvalidField and listed.metadata == {} and listed.field is None


def test_from_http_error_knows_the_engines_types_only() -> None:
    assert from_http_error(400, "", "m", metadata={}) is None
    assert from_http_error(400, "BadRequestError", "m", metadata={}) is None
    assert from_http_error(None, "QUEUE_FULL", "m", metadata={}) is None
    assert from_http_error(503, "StreamError", "m", metadata={}) is None  # the client's own classes are not sent
    assert set(BY_HTTP_TYPE) == {*BY_REASON, "EngineUnavailable", "Cancelled", "RequestTooLarge"}
    err = from_http_error(429, "QUEUE_FULL", "m", metadata={"queueDepth": 3}, field="f", retry_delay=2.0)
    assert type(err) is QueueFull and (err.message, err.metadata, err.field, err.retry_delay, err.http_status) == (
        "m", {"queueDepth": "3"}, "f", 2.0, 429)
