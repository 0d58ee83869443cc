"""The one table: every exception round-trips through a real status to the same exception."""

from __future__ import annotations

import grpc
import pytest

from engine.v1 import engine_pb2 as pb
from shared import errors
from shared.errors import (
    BY_REASON,
    ContextLengthExceeded,
    DeadlineExceeded,
    EngineDraining,
    EngineUnavailable,
    InternalError,
    InvalidField,
    QueueFull,
    SequenceError,
    Unauthenticated,
    from_rpc_error,
    to_status,
)

EXPECTED = {
    InvalidField: (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD"),
    ContextLengthExceeded: (grpc.StatusCode.INVALID_ARGUMENT, "CONTEXT_LENGTH_EXCEEDED"),
    QueueFull: (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_FULL"),
    SequenceError: (grpc.StatusCode.ABORTED, "SEQUENCE_ABORTED"),
    EngineDraining: (grpc.StatusCode.UNAVAILABLE, "ENGINE_DRAINING"),
    DeadlineExceeded: (grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"),
    Unauthenticated: (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED"),
    InternalError: (grpc.StatusCode.INTERNAL, "INTERNAL"),
}

SAMPLES = [
    InvalidField("max_new_tokens", 0, "max_new_tokens must be 1..4096, got 0"),
    ContextLengthExceeded.build(4000, 200, 2048),
    QueueFull.build(8, 8, 0.5),
    SequenceError.build("r1", 3, "boom"),
    EngineDraining.build(30.0),
    DeadlineExceeded.build("r2", 5),
    Unauthenticated("missing bearer token", metadata={"scheme": "Bearer"}),
    InternalError.build("r3"),
]


class FakeRpcError(grpc.RpcError):
    """What a client library hands over: code, details and trailing metadata of a real status."""

    def __init__(self, status: grpc.Status) -> None:
        self._status = status

    def code(self) -> grpc.StatusCode:
        return self._status.code

    def details(self) -> str:
        return self._status.details

    def trailing_metadata(self):  # type: ignore[no-untyped-def]
        return self._status.trailing_metadata


def test_table_matches_the_design_and_the_proto_enum():
    assert {cls: (cls.code, cls.reason) for cls in EXPECTED} == EXPECTED
    proto_reasons = {name.removeprefix("ERROR_REASON_") for name in pb.ErrorReason.keys()} - {"UNSPECIFIED"}
    assert set(BY_REASON) == proto_reasons


@pytest.mark.parametrize("err", SAMPLES, ids=lambda e: type(e).__name__)
def test_round_trip(err):
    back = from_rpc_error(FakeRpcError(to_status(err)))
    assert type(back) is type(err)
    assert (back.message, back.metadata, back.retry_delay, back.field) == (err.message, err.metadata, err.retry_delay,
                                                                          err.field)
    assert all(key[0].islower() and "_" not in key for key in back.metadata), "metadata keys are lowerCamelCase"


def test_extras_follow_the_table():
    by_type = {type(e): errors.to_status_proto(e) for e in SAMPLES}
    type_urls = {cls: [d.type_url.rsplit(".", 1)[-1] for d in status.details] for cls, status in by_type.items()}
    assert type_urls[InvalidField] == ["ErrorInfo", "BadRequest"]
    assert type_urls[QueueFull] == ["ErrorInfo", "RetryInfo"]
    assert type_urls[EngineDraining] == ["ErrorInfo", "RetryInfo"]
    for cls in (ContextLengthExceeded, SequenceError, DeadlineExceeded, Unauthenticated, InternalError):
        assert type_urls[cls] == ["ErrorInfo"]


def test_messages_name_the_values():
    assert "4000 + 200 = 4200" in SAMPLES[1].message and "2048" in SAMPLES[1].message
    assert "8 of 8" in SAMPLES[2].message


def test_transport_failures_carry_no_details_and_map_by_code():
    status = to_status(EngineUnavailable("engine stopped on a fatal error"))
    assert not any(key == errors.STATUS_DETAILS_KEY for key, _ in status.trailing_metadata)
    assert type(from_rpc_error(FakeRpcError(status))) is EngineUnavailable
