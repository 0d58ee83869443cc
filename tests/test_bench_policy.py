"""The client's one policy table, on the exceptions that shared.errors builds from the wire."""

from __future__ import annotations

import random

import grpc
import pytest

from bench_client.policy import (
    BY_CLASS,
    BY_CODE,
    Action,
    backoff_delay,
    decide,
    decide_preview,
    decide_server_info,
    rule_for,
)
from shared.errors import (
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
    SequenceError,
    StreamError,
    TransportError,
    Unauthenticated,
)


def received(cls: type[EngineError], code: grpc.StatusCode, message: str = "m") -> EngineError:
    """An error as from_rpc_error builds it for a status that came without details."""
    err = cls(message)
    err.status_code = code  # type: ignore[attr-defined]
    return err


@pytest.mark.parametrize(("error", "before", "mid"), [
    (ContextLengthExceeded.build(600, 32, 512), Action.SKIP_POINT, Action.COUNT_FAILED),
    (InvalidField("max_new_tokens", 0, "max_new_tokens must be 1..4096, got 0"), Action.SKIP_POINT,
     Action.COUNT_FAILED),
    (QueueFull.build(4, 4, 0.5), Action.RETRY_AFTER_BACKOFF, Action.COUNT_FAILED),
    (received(TransportError, grpc.StatusCode.RESOURCE_EXHAUSTED), Action.SKIP_POINT, Action.COUNT_FAILED),
    (EngineDraining.build(30.0), Action.WAIT_FOR_HEALTH_THEN_RETRY, Action.COUNT_FAILED),
    (received(EngineUnavailable, grpc.StatusCode.UNAVAILABLE), Action.WAIT_FOR_HEALTH_THEN_RETRY,
     Action.COUNT_FAILED),
    (SequenceError.build("r1", 3, "boom"), Action.COUNT_FAILED, Action.COUNT_FAILED),
    (DeadlineExceeded.build("r1", 3), Action.COUNT_FAILED, Action.COUNT_FAILED),
    (received(ClientTimeout, grpc.StatusCode.DEADLINE_EXCEEDED), Action.COUNT_FAILED, Action.COUNT_FAILED),
    (received(TransportError, grpc.StatusCode.INVALID_ARGUMENT), Action.SKIP_POINT, Action.COUNT_FAILED),
    (received(TransportError, grpc.StatusCode.UNAVAILABLE), Action.WAIT_FOR_HEALTH_THEN_RETRY, Action.COUNT_FAILED),
    (received(TransportError, grpc.StatusCode.UNAUTHENTICATED), Action.STOP_SWEEP, Action.STOP_SWEEP),
    (received(TransportError, grpc.StatusCode.PERMISSION_DENIED), Action.STOP_SWEEP, Action.STOP_SWEEP),
    # what the HTTP adapter builds (openai_errors.py): the same classes, so the same rows
    (BadRequest("top_k must be >= 0"), Action.SKIP_POINT, Action.COUNT_FAILED),
    (PermissionDenied("forbidden"), Action.STOP_SWEEP, Action.STOP_SWEEP),
    (received(StreamError, grpc.StatusCode.INTERNAL), Action.COUNT_FAILED, Action.COUNT_FAILED),
    (received(StreamError, grpc.StatusCode.UNAVAILABLE), Action.COUNT_FAILED, Action.COUNT_FAILED),
    (InternalError.build("r1"), Action.COUNT_FAILED, Action.COUNT_FAILED),
    (received(TransportError, grpc.StatusCode.UNKNOWN), Action.COUNT_FAILED, Action.COUNT_FAILED),
    (received(Cancelled, grpc.StatusCode.CANCELLED), Action.WAIT_FOR_HEALTH_THEN_RETRY, Action.COUNT_FAILED),
    (Unauthenticated("no token"), Action.STOP_SWEEP, Action.STOP_SWEEP),
    (received(TransportError, grpc.StatusCode.UNIMPLEMENTED), Action.STOP_SWEEP, Action.STOP_SWEEP),
    (received(TransportError, grpc.StatusCode.DATA_LOSS), Action.COUNT_FAILED, Action.COUNT_FAILED),
])
def test_policy_table(error: EngineError, before: Action, mid: Action) -> None:
    assert decide(error, first_token_seen=False) is before
    assert decide(error, first_token_seen=True) is mid


def test_every_row_has_a_reason_to_exist() -> None:
    for key, rule in [*BY_CLASS.items(), *BY_CODE.items()]:
        assert rule.why, key
    # a class row wins over its code's row: QUEUE_FULL retries, gRPC's own size limit skips
    assert rule_for(QueueFull.build(1, 1, 0.1)).before_first_token is Action.RETRY_AFTER_BACKOFF
    assert rule_for(received(TransportError, grpc.StatusCode.RESOURCE_EXHAUSTED)).before_first_token is Action.SKIP_POINT
    # the most specific class decides: a subclass without a row of its own takes its parent's
    assert rule_for(ContextLengthExceeded.build(9, 1, 8)) is BY_CLASS[type(InvalidField("f", 1, "m")).__mro__[1]]


def test_a_row_stops_the_sweep_before_the_first_token_exactly_when_it_does_mid_stream() -> None:
    # decide_preview reads the before-first-token action; docs/mutation-survivors.toml counts reading
    # the mid-stream one instead as equivalent because of this
    for key, rule in [*BY_CLASS.items(), *BY_CODE.items()]:
        assert (rule.before_first_token is Action.STOP_SWEEP) == (rule.mid_stream is Action.STOP_SWEEP), key


def test_setup_calls_wait_only_where_the_table_waits_and_the_preview_stops_only_for_credentials() -> None:
    assert decide_server_info(received(EngineUnavailable, grpc.StatusCode.UNAVAILABLE)) is \
        Action.WAIT_FOR_HEALTH_THEN_RETRY
    assert decide_server_info(EngineDraining.build(1.0)) is Action.WAIT_FOR_HEALTH_THEN_RETRY
    for err in (QueueFull.build(1, 1, 0.1), InternalError.build("r"), Unauthenticated("no"),
                received(TransportError, grpc.StatusCode.UNIMPLEMENTED)):
        assert decide_server_info(err) is Action.STOP_SWEEP, err
    assert decide_preview(InvalidField("chat", "", "no chat template")) is Action.COUNT_FAILED
    assert decide_preview(received(EngineUnavailable, grpc.StatusCode.UNAVAILABLE)) is Action.COUNT_FAILED
    assert decide_preview(Unauthenticated("no token")) is Action.STOP_SWEEP


def test_backoff_honours_retry_info_and_is_bounded() -> None:
    rng = random.Random(0)
    for attempt in range(1, 10):
        delay = backoff_delay(attempt, server_delay=0.5, initial=0.01, maximum=2.0, rng=rng)
        assert 0.5 <= delay <= max(0.5, min(2.0, 0.01 * 2 ** (attempt - 1))) * 1.5
    grows = [backoff_delay(a, server_delay=None, initial=0.1, maximum=10.0, rng=random.Random(1)) for a in (1, 2, 3)]
    assert grows[0] < grows[1] < grows[2]
    assert backoff_delay(20, server_delay=None, initial=0.1, maximum=1.0, rng=rng) <= 1.5


class FixedRandom(random.Random):
    """A jitter source that always draws `value`, so a delay can be checked exactly."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


def test_backoff_doubles_from_initial_and_jitters_up_to_half() -> None:
    def delay(attempt: int, draw: float, server_delay: float | None = None, maximum: float = 10.0) -> float:
        return backoff_delay(attempt, server_delay=server_delay, initial=0.1, maximum=maximum, rng=FixedRandom(draw))

    assert [delay(a, 0.0) for a in (1, 2, 3, 4)] == pytest.approx([0.1, 0.2, 0.4, 0.8])
    assert delay(3, 1.0) == pytest.approx(0.6)  # +50% at most
    assert delay(10, 0.0, maximum=1.0) == pytest.approx(1.0)
    assert delay(1, 0.0, server_delay=0.5) == pytest.approx(0.5)
    assert delay(4, 0.0, server_delay=0.5) == pytest.approx(0.8)  # the server's delay is a floor, not a value
