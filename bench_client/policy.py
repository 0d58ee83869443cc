"""The client's one policy table: what the sweep does about each failed call.

The point runner asks `decide()` and does what it answers; nothing else in the client chooses
between skipping, retrying, failing and stopping. With replicas behind one target (round_robin
with client-side health checking, shared/engine_channel.py), UNAVAILABLE or ENGINE_DRAINING
before the first token is retried at once when another replica is serving; the sweep waits for
health only when none is. Mid-stream the same codes count the request failed: a replica's death
stays visible in the point's counts. The rows follow the engine.v1 failure contract
(proto/engine/v1/engine.proto).
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

import grpc

from shared.errors import EngineError, status_code_of


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

# (status code, ErrorInfo reason or None for "any reason, or no details") -> rule.
# A row with a reason wins over the row of the same code with None.
TABLE: dict[tuple[grpc.StatusCode, str | None], Rule] = {
    (_C.INVALID_ARGUMENT, None): Rule(_A.SKIP_POINT, _A.COUNT_FAILED,
                                      "the request cannot be served as asked; retrying cannot help"),
    (_C.RESOURCE_EXHAUSTED, "QUEUE_FULL"): Rule(_A.RETRY_AFTER_BACKOFF, _A.COUNT_FAILED,
                                                "the queue is full now; it drains"),
    # Without QUEUE_FULL it is gRPC's own message-size limit: the same prompt fails every time.
    (_C.RESOURCE_EXHAUSTED, None): Rule(_A.SKIP_POINT, _A.COUNT_FAILED,
                                        "a gRPC limit that the same request hits again"),
    (_C.UNAVAILABLE, None): Rule(_A.WAIT_FOR_HEALTH_THEN_RETRY, _A.COUNT_FAILED,
                                 "the replica is draining, restarting or down; tokens already streamed are lost, "
                                 "so a stream cut by its death is failed, never retried"),
    (_C.ABORTED, None): Rule(_A.COUNT_FAILED, _A.COUNT_FAILED, "one sequence failed inside the engine"),
    (_C.DEADLINE_EXCEEDED, None): Rule(_A.COUNT_FAILED, _A.COUNT_FAILED, "timed out"),
    (_C.INTERNAL, None): Rule(_A.COUNT_FAILED, _A.COUNT_FAILED, "an engine bug on this request"),
    (_C.UNKNOWN, None): Rule(_A.COUNT_FAILED, _A.COUNT_FAILED, "an unmapped engine exception"),
    # This client's own cancellations never arrive here (grpc.aio raises asyncio.CancelledError for
    # them): a CANCELLED status comes from the engine's side, where gRPC cancels the calls it had
    # accepted but not started when the server stops. The engine is going away, as for UNAVAILABLE.
    (_C.CANCELLED, None): Rule(_A.WAIT_FOR_HEALTH_THEN_RETRY, _A.COUNT_FAILED,
                               "the engine's server stopped with the call unstarted; tokens already streamed are lost"),
    (_C.UNAUTHENTICATED, None): Rule(_A.STOP_SWEEP, _A.STOP_SWEEP, "every request will fail: fix credentials"),
    (_C.PERMISSION_DENIED, None): Rule(_A.STOP_SWEEP, _A.STOP_SWEEP, "every request will fail: fix credentials"),
    (_C.UNIMPLEMENTED, None): Rule(_A.STOP_SWEEP, _A.STOP_SWEEP, "the target does not serve engine.v1"),
}
# Any other code (NOT_FOUND, FAILED_PRECONDITION, DATA_LOSS, ...) is not in the contract.
DEFAULT_RULE = Rule(_A.COUNT_FAILED, _A.COUNT_FAILED, "a status outside the engine.v1 contract")


def rule_for(code: grpc.StatusCode, reason: str | None) -> Rule:
    return TABLE.get((code, reason)) or TABLE.get((code, None)) or DEFAULT_RULE


def decide(err: EngineError, *, first_token_seen: bool) -> Action:
    """The action for one failed call, given whether any token of it had arrived."""
    rule = rule_for(status_code_of(err), err.reason or None)
    return rule.mid_stream if first_token_seen else rule.before_first_token


def backoff_delay(attempt: int, *, server_delay: float | None, initial: float, maximum: float,
                  rng: random.Random) -> float:
    """Seconds to wait before retry number `attempt` (1-based): exponential from `initial`, capped at
    `maximum`, never below the server's RetryInfo delay, with up to +50% jitter on top."""
    base = min(maximum, initial * 2 ** (attempt - 1))
    if server_delay is not None:
        base = max(base, server_delay)
    return base * (1.0 + 0.5 * rng.random())
