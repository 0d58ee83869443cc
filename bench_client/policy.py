"""The client's one policy table: what the sweep does about each failed call.

The point runner asks `decide()` and does what it answers; nothing else in the client chooses
between skipping, retrying, failing and stopping. With replicas behind one target (round_robin
with client-side health checking, shared/engine_channel.py), UNAVAILABLE or ENGINE_DRAINING
before the first token is retried at once when another replica is serving; the sweep waits for
health only when none is. Mid-stream the same codes count the request failed: a replica's death
stays visible in the point's counts. The rows follow the engine.v1 failure contract
(proto/engine/v1/engine.proto); the HTTP adapter (openai_errors.py) builds the same classes from
an OpenAI-compatible server's answers, so one table decides for both protocols.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

import grpc

from shared.errors import (
    Cancelled,
    ClientTimeout,
    DeadlineExceeded,
    EngineDraining,
    EngineError,
    EngineUnavailable,
    InternalError,
    InvalidRequest,
    PermissionDenied,
    QueueFull,
    SequenceError,
    StreamError,
    Unauthenticated,
    status_code_of,
)


class Action(enum.Enum):
    SKIP_POINT = "skip_point"  # the point cannot run as asked: record it skipped, send nothing more
    RETRY_AFTER_BACKOFF = "retry_after_backoff"  # wait >= the server's retry delay, retry (bounded)
    # this replica is draining or down: retry at once while another replica of the target serves
    # (round_robin with health checking sends the retry there); when none does, wait for health
    # (bounded by policy.health_wait_s), then retry
    WAIT_FOR_HEALTH_THEN_RETRY = "wait_for_health_then_retry"
    COUNT_FAILED = "count_failed"  # this request failed; counted by code, the point goes on
    STOP_SWEEP = "stop_sweep"  # no point can succeed (credentials, wrong service): stop, resumable


@dataclass(frozen=True)
class Rule:
    before_first_token: Action
    mid_stream: Action
    why: str


_C = grpc.StatusCode
_A = Action

# The domain classes that the adapters build (shared.errors): an error's most specific class that
# has a row decides. Both protocols arrive here: the HTTP adapter builds the same classes.
BY_CLASS: dict[type[EngineError], Rule] = {
    # InvalidField, ContextLengthExceeded (the sweep learns the limit from it) and HTTP's BadRequest
    InvalidRequest: Rule(_A.SKIP_POINT, _A.COUNT_FAILED, "the request cannot be served as asked; retrying cannot help"),
    QueueFull: Rule(_A.RETRY_AFTER_BACKOFF, _A.COUNT_FAILED, "the queue is full now (HTTP 429/503); it drains"),
    EngineDraining: Rule(_A.WAIT_FOR_HEALTH_THEN_RETRY, _A.COUNT_FAILED,
                         "the replica is draining; tokens already streamed are lost, so a cut stream is failed"),
    EngineUnavailable: Rule(_A.WAIT_FOR_HEALTH_THEN_RETRY, _A.COUNT_FAILED,
                            "the server is restarting or down (connection refused or reset); a stream cut by its "
                            "death is failed, never retried"),
    # This client's own cancellations never arrive here (grpc.aio raises asyncio.CancelledError for
    # them): a CANCELLED status comes from the engine's side, where gRPC cancels the calls it had
    # accepted but not started when the server stops. The engine is going away, as for UNAVAILABLE.
    Cancelled: Rule(_A.WAIT_FOR_HEALTH_THEN_RETRY, _A.COUNT_FAILED,
                    "the engine's server stopped with the call unstarted; tokens already streamed are lost"),
    SequenceError: Rule(_A.COUNT_FAILED, _A.COUNT_FAILED, "one sequence failed inside the engine"),
    DeadlineExceeded: Rule(_A.COUNT_FAILED, _A.COUNT_FAILED, "the engine's deadline passed"),
    ClientTimeout: Rule(_A.COUNT_FAILED, _A.COUNT_FAILED, "the client's policy.request_timeout_s passed"),
    InternalError: Rule(_A.COUNT_FAILED, _A.COUNT_FAILED, "an engine bug on this request"),
    StreamError: Rule(_A.COUNT_FAILED, _A.COUNT_FAILED, "the server failed the request inside its stream"),
    Unauthenticated: Rule(_A.STOP_SWEEP, _A.STOP_SWEEP, "every request will fail: fix credentials"),
    PermissionDenied: Rule(_A.STOP_SWEEP, _A.STOP_SWEEP, "every request will fail: fix credentials"),
}

# A status that came without details (TransportError) has no class of its own: its code decides.
BY_CODE: dict[grpc.StatusCode, Rule] = {
    _C.INVALID_ARGUMENT: Rule(_A.SKIP_POINT, _A.COUNT_FAILED, "a refusal without details; retrying cannot help"),
    # gRPC's own message-size limit: the same prompt fails every time.
    _C.RESOURCE_EXHAUSTED: Rule(_A.SKIP_POINT, _A.COUNT_FAILED, "a gRPC limit that the same request hits again"),
    _C.UNAVAILABLE: Rule(_A.WAIT_FOR_HEALTH_THEN_RETRY, _A.COUNT_FAILED, "the server is down or unreachable"),
    _C.UNAUTHENTICATED: Rule(_A.STOP_SWEEP, _A.STOP_SWEEP, "every request will fail: fix credentials"),
    _C.PERMISSION_DENIED: Rule(_A.STOP_SWEEP, _A.STOP_SWEEP, "every request will fail: fix credentials"),
    _C.UNIMPLEMENTED: Rule(_A.STOP_SWEEP, _A.STOP_SWEEP, "the target does not serve this API (or this route)"),
}
# Any other code (UNKNOWN, INTERNAL, NOT_FOUND, DATA_LOSS, ...): this request failed.
DEFAULT_RULE = Rule(_A.COUNT_FAILED, _A.COUNT_FAILED, "a status outside the contract")


def rule_for(err: EngineError) -> Rule:
    """The row of the error's most specific class that has one, else of its status code."""
    for cls in type(err).__mro__:
        if cls in BY_CLASS:
            return BY_CLASS[cls]
    return BY_CODE.get(status_code_of(err), DEFAULT_RULE)


def decide(err: EngineError, *, first_token_seen: bool) -> Action:
    """The action for one failed call, given whether any token of it had arrived."""
    rule = rule_for(err)
    return rule.mid_stream if first_token_seen else rule.before_first_token


def decide_server_info(err: EngineError) -> Action:
    """A failed GetServerInfo (or /props) before the points: wait for health and ask again when the
    table would wait for that error, else stop the sweep (nothing can be measured without it)."""
    action = decide(err, first_token_seen=False)
    return action if action is Action.WAIT_FOR_HEALTH_THEN_RETRY else Action.STOP_SWEEP


def decide_preview(err: EngineError) -> Action:
    """A failed preview question: the sweep goes on (no point depends on it; a model without a chat
    template refuses it), unless the table stops the sweep for that error (credentials)."""
    action = decide(err, first_token_seen=False)
    return action if action is Action.STOP_SWEEP else Action.COUNT_FAILED


def backoff_delay(attempt: int, *, server_delay: float | None, initial: float, maximum: float,
                  rng: random.Random) -> float:
    """Seconds to wait before retry number `attempt` (1-based): exponential from `initial`, capped at
    `maximum`, never below the server's RetryInfo delay, with up to +50% jitter on top."""
    base = min(maximum, initial * 2 ** (attempt - 1))
    if server_delay is not None:
        base = max(base, server_delay)
    return base * (1.0 + 0.5 * rng.random())
