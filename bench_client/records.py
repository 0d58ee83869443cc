"""Building the JSON records of results.jsonl and requests.jsonl (schema documented in results.py)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from bench_client import metrics
from bench_client.point import PointOutcome, PointSpec, RequestResult
from bench_client.results import SCHEMA, rate_to_json
from bench_client.server_api import ENGINE_V1, ServerInfo

ERROR_RATE_EXCEEDED = "ERROR_RATE_EXCEEDED"


def _base(spec: PointSpec, engine: Mapping[str, Any] | None, target: str, server_info: ServerInfo | None,
          run_id: str, started_at: float, server: str, api: str, workload: Mapping[str, Any] | None) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "server": server,
        "api": api,
        "context_tokens": spec.context_tokens,
        "max_new_tokens": spec.max_new_tokens,
        "concurrency": spec.concurrency,
        "request_rate": rate_to_json(spec.request_rate),
        "prefix_tokens": spec.prefix_tokens,
        "prefix_groups": spec.prefix_groups,
        **(workload or {}),
        "engine": dict(engine) if engine is not None else None,
        "target": target,
        "server_info": server_info.as_dict() if server_info is not None else None,
        "run_id": run_id,
        "started_at": started_at,
        "finished_at": time.time(),
    }


def skipped_record(spec: PointSpec, *, engine: Mapping[str, Any] | None, target: str,
                   server_info: ServerInfo | None, run_id: str, started_at: float, reason: str, reason_metadata: Mapping[str, str], message: str, without_sending: bool,
                   sent: int = 0, code: str | None = None, server: str = "", api: str = ENGINE_V1,
                   workload: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`code`: the status the refusal came with (gRPC name, or HTTP_400...); None when not sent."""
    return {
        **_base(spec, engine, target, server_info, run_id, started_at, server, api, workload),
        "status": "skipped",
        "reason": reason,
        "reason_metadata": dict(reason_metadata),
        "message": message,
        "skipped_without_sending": without_sending,
        "skip_code": code,
        "requests": {"sent": sent, "completed": 0, "failed": 0, "failed_by_code": {}, "failed_by_reason": {},
                     "retries": 0, "connection_resends": 0, "warmup": 0, "by_replica": {}, "truncated": 0},
        "metrics": None,
    }


def point_record(outcome: PointOutcome, *, engine: Mapping[str, Any] | None, target: str,
                 server_info: ServerInfo, run_id: str, started_at: float, warmup: int,
                 max_error_rate: float, server: str = "", api: str = ENGINE_V1,
                 workload: Mapping[str, Any] | None = None, percentiles: Sequence[float] = metrics.PERCENTILES,
                 slo: metrics.SLO | None = None) -> dict[str, Any]:
    """The record of a point that ran: `failed` when its error rate exceeds max_error_rate. Truncated
    requests count as failed (code and reason TRUNCATED) and are named in the message. `workload`:
    the sweep's workload keys the record carries (dataset, endpoint, ...: results.py)."""
    ok = [r.timeline for r in outcome.requests if r.ok and r.timeline is not None]
    failed = [r for r in outcome.requests if not r.ok]
    truncated = sum(1 for r in failed if r.truncated)
    by_code = Counter(r.status_code or "UNKNOWN" for r in failed)
    by_reason = Counter(r.reason for r in failed if r.reason)
    error_rate = len(failed) / len(outcome.requests) if outcome.requests else 0.0
    status = "failed" if error_rate > max_error_rate else "ok"
    return {
        **_base(outcome.spec, engine, target, server_info, run_id, started_at, server, api, workload),
        "status": status,
        "reason": ERROR_RATE_EXCEEDED if status == "failed" else None,
        "reason_metadata": {"errorRate": f"{error_rate:.4g}", "maxErrorRate": f"{max_error_rate:g}"}
        if status == "failed" else {},
        "message": (f"{len(failed)} of {len(outcome.requests)} requests failed ({dict(by_code)})"
                    + (f"; {truncated} truncated by the server without an error" if truncated else ""))
        if failed else "",
        "skipped_without_sending": False,
        "requests": {
            "sent": len(outcome.requests),
            "completed": len(ok),
            "failed": len(failed),
            "failed_by_code": dict(sorted(by_code.items())),
            "failed_by_reason": dict(sorted(by_reason.items())),
            "retries": outcome.retries,
            "connection_resends": outcome.connection_resends,
            "warmup": warmup,
            "by_replica": by_replica(outcome.requests),
            "truncated": truncated,
        },
        "metrics": metrics.compute(ok, outcome.duration_s, percentiles=percentiles, slo=slo,
                                   measured=len(outcome.requests)).as_dict(),
    }


NO_REPLICA = "none"  # by_replica's key for requests whose last attempt reached no replica


def by_replica(requests: Sequence[RequestResult]) -> dict[str, int]:
    """Replica address -> measured requests whose last attempt it answered (sums to `sent`)."""
    return dict(sorted(Counter(r.replica or NO_REPLICA for r in requests).items()))


def request_record(spec: PointSpec, outcome: RequestResult, *, engine: Mapping[str, Any] | None,
                   run_id: str, server: str = "") -> dict[str, Any]:
    """One line of requests.jsonl (--detail): `sent_at` in Unix seconds (the last attempt); the
    other times in seconds from it; `messages` lists [arrival, tokens] per streamed message;
    `prompt_tokens` and `cached_prompt_tokens` as the engine counted them (the latter: from its
    prefix cache); `prefix_group` is the shared prefix the prompt began with (null without one);
    `peer` is the replica that answered the last attempt (its engine-replica header; null when the
    call reached none); `status` is "ok", "failed" or "truncated" (the server cut it short without
    an error: its timeline is kept); `usage_completion_tokens` and `server_timings` are the server's
    own count and view (null where it sent none)."""
    record: dict[str, Any] = {
        "run_id": run_id,
        "server": server,
        "engine": dict(engine) if engine is not None else None,
        "context_tokens": spec.context_tokens,
        "max_new_tokens": spec.max_new_tokens,
        "concurrency": spec.concurrency,
        "request_rate": rate_to_json(spec.request_rate),
        "prefix_tokens": spec.prefix_tokens,
        "prefix_groups": spec.prefix_groups,
        "prefix_group": outcome.index % spec.prefix_groups if spec.prefix_tokens else None,
        "index": outcome.index,
        "warmup": outcome.warmup,
        "attempts": outcome.attempts,
        "sent_at": outcome.sent_at_unix,
        "status": "ok" if outcome.ok else "truncated" if outcome.truncated else "failed",
        "code": outcome.status_code,
        "reason": outcome.reason,
        "message": outcome.message,
        "peer": outcome.replica,
    }
    timeline = outcome.timeline
    if timeline is not None:
        record.update(
            ttft_s=timeline.ttft,
            e2el_s=timeline.e2el,
            output_tokens=timeline.output_tokens,
            output_token_source=timeline.output_token_source,
            streamed_tokens=timeline.streamed_tokens,
            prompt_tokens=timeline.prompt_tokens,
            cached_prompt_tokens=timeline.cached_prompt_tokens,
            messages=[[round(a.at - timeline.sent_at, 6), a.num_tokens] for a in timeline.arrivals],
            engine_queue_s=timeline.engine_queue_s,
            engine_ttft_s=timeline.engine_ttft_s,
            usage_completion_tokens=timeline.usage_completion_tokens,
            server_timings=dict(timeline.server_timings) if timeline.server_timings else None,
        )
    return record
