"""The exact values shared.errors puts on the wire, built inside each test.

The round-trip tests in test_errors_table.py compare an error with itself after a trip through a
status, so a wrong message or metadata key survives them (both sides carry it). These pin what a
client reads: each builder's message and metadata, the details of the status, and how a status
that arrives without our details is read (found by `make mutate`, docs/mutation-testing.md).
"""

from __future__ import annotations

import pickle

import grpc
from google.rpc import error_details_pb2, status_pb2

from shared.errors import (
    DOMAIN,
    STATUS_DETAILS_KEY,
    ClientTimeout,
    ContextLengthExceeded,
    DeadlineExceeded,
    EngineDraining,
    EngineError,
    EngineUnavailable,
    InternalError,
    InvalidField,
    QueueFull,
    SequenceError,
    TransportError,
    from_rpc_error,
    status_code_of,
    to_status,
    to_status_proto,
    wire_code,
)


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str | None, trailing_metadata=()) -> None:  # type: ignore[no-untyped-def]
        self._code, self._details, self._trailing = code, details, trailing_metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str | None:
        return self._details

    def trailing_metadata(self):  # type: ignore[no-untyped-def]
        return self._trailing


def received(status: grpc.Status) -> EngineError:
    return from_rpc_error(FakeRpcError(status.code, status.details, status.trailing_metadata))


def test_builders_name_each_value_in_message_and_metadata() -> None:
    built = {
        "context": ContextLengthExceeded.build(4000, 200, 2048),
        "queue": QueueFull.build(7, 8, 0.5),
        "sequence": SequenceError.build("r1", 3, "boom"),
        "draining": EngineDraining.build(30.0),
        "deadline": DeadlineExceeded.build("r2", 5),
        "internal": InternalError.build("r3"),
    }
    expected = {
        "context": ("prompt_tokens + max_new_tokens must be <= max_context_tokens 2048, got 4000 + 200 = 4200",
                    {"promptTokens": "4000", "maxNewTokens": "200", "maxContextTokens": "2048"}, None),
        "queue": ("waiting queue is full: 7 of 8 places taken", {"queueDepth": "7", "queueCapacity": "8"}, 0.5),
        "sequence": ("sequence r1 aborted after 3 generated tokens: boom",
                     {"requestId": "r1", "generatedTokens": "3", "cause": "boom"}, None),
        "draining": ("engine is draining (grace period 30 s) and admits no new requests", {"graceSeconds": "30"},
                     1.0),
        "deadline": ("deadline of request r2 passed after 5 generated tokens",
                     {"requestId": "r2", "generatedTokens": "5"}, None),
        "internal": ("internal error while handling request r3; see the engine log", {"requestId": "r3"}, None),
    }
    for key, err in built.items():
        assert (err.message, err.metadata, err.retry_delay) == expected[key], key
        assert str(err) == err.message, key


def test_invalid_field_metadata_and_value_clipping() -> None:
    err = InvalidField("max_new_tokens", 0, "max_new_tokens must be 1..4096, got 0")
    assert (str(err), err.field) == ("max_new_tokens must be 1..4096, got 0", "max_new_tokens")
    assert err.metadata == {"field": "max_new_tokens", "value": "0"}
    # a string value is sent as it is, anything else as its repr
    assert InvalidField("request_id", "has space", "m").metadata["value"] == "has space"
    assert InvalidField("ids", [1, 2], "m").metadata["value"] == "[1, 2]"
    # values longer than 64 characters are clipped to 64, the last three being "..."
    assert InvalidField("f", "x" * 64, "m").metadata["value"] == "x" * 64
    assert InvalidField("f", "x" * 65, "m").metadata["value"] == "x" * 61 + "..."


def test_status_details_carry_the_table() -> None:
    err = InvalidField("prompt", None, "prompt must be set")
    proto = to_status_proto(err)
    assert proto.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and proto.message == "prompt must be set"
    info, bad = error_details_pb2.ErrorInfo(), error_details_pb2.BadRequest()
    assert proto.details[0].Unpack(info) and proto.details[1].Unpack(bad)
    assert (info.reason, info.domain, dict(info.metadata)) == ("INVALID_FIELD", DOMAIN, {"field": "prompt",
                                                                                          "value": "None"})
    assert [(v.field, v.description) for v in bad.field_violations] == [("prompt", "prompt must be set")]
    status = to_status(QueueFull.build(1, 1, 0.25))
    assert (status.code, status.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue is full: 1 of 1 places taken")


def test_a_plain_status_keeps_its_message() -> None:
    status = to_status(EngineUnavailable("engine stopped on a fatal error"))
    assert (status.code, status.details, tuple(status.trailing_metadata)) == (
        grpc.StatusCode.UNAVAILABLE, "engine stopped on a fatal error", ())


def test_received_status_without_details() -> None:
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.DATA_LOSS, None))
    assert type(err) is TransportError
    assert (err.message, err.metadata, err.retry_delay, err.field) == ("", {}, None, None)
    assert status_code_of(err) == grpc.StatusCode.DATA_LOSS
    # grpc's own deadline, raised in the client: the client's timeout, never the engine's DeadlineExceeded
    deadline = from_rpc_error(FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    assert type(deadline) is ClientTimeout and deadline.message == "Deadline Exceeded"
    assert (status_code_of(deadline), deadline.reason) == (grpc.StatusCode.DEADLINE_EXCEEDED, "CLIENT_TIMEOUT")
    assert wire_code(deadline) == "DEADLINE_EXCEEDED"


def test_received_code_is_kept_even_when_the_reason_decides_the_class() -> None:
    err = received(to_status(QueueFull.build(2, 2, 1.0)))
    assert type(err) is QueueFull and status_code_of(err) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_bad_request_without_violations_has_no_field() -> None:
    info = error_details_pb2.ErrorInfo(reason="INVALID_FIELD", domain=DOMAIN)
    status = status_pb2.Status(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="bad")
    status.details.add().Pack(info)
    status.details.add().Pack(error_details_pb2.BadRequest())
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad",
                                      ((STATUS_DETAILS_KEY, status.SerializeToString()),)))
    assert type(err) is InvalidField and err.field is None and err.message == "bad"


def test_pickle_keeps_every_attribute() -> None:
    over_http = QueueFull("slots busy", retry_delay=2.0)
    over_http.http_status = 429
    for err in (InvalidField("f", 1, "f must be 0, got 1"), QueueFull.build(3, 4, 0.5), over_http):
        back = pickle.loads(pickle.dumps(err))
        assert (type(back), back.message, back.metadata, back.retry_delay, back.field, back.http_status) == (
            type(err), err.message, err.metadata, err.retry_delay, err.field, err.http_status)
        assert back.message != "None" and (back.field is not None or back.retry_delay is not None)
        assert back.metadata or err is over_http
    assert wire_code(pickle.loads(pickle.dumps(over_http))) == "HTTP_429"


def test_repr_names_class_reason_and_metadata() -> None:
    assert repr(QueueFull.build(1, 2, 0.5)) == (
        "QueueFull('waiting queue is full: 1 of 2 places taken', reason='QUEUE_FULL', "
        "metadata={'queueDepth': '1', 'queueCapacity': '2'})")
