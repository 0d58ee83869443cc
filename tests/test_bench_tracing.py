"""Traces of a sweep: one trace, sweep -> point -> request spans from the client, each Decode
continued by the engine's SERVER span; skips and rejections carry their reason. Both processes
export over OTLP/gRPC to a real receiver started by the test."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.bench_helpers import ROOT, cli, managed_engine, sweep_raw, write_config
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

DECODE = "engine.v1.EngineService/Decode"
INVALID_ARGUMENT = 3
CANCELLED = 1


def sweep_env(**otel: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return {**base, "PYTHONUNBUFFERED": "1", **otel}


def run_sweep(config: Path, out: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli("sweep", str(config), "--out", str(out)), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180, check=False)


def by_parent(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    return [s for s in spans if s.parent_span_id == parent.span_id]


def test_a_sweep_is_one_trace_continued_by_the_engine(tmp_path: Path) -> None:
    # context 16 runs; 100 + 8 > 64 is refused by the engine (sent); 120 is skipped without sending
    raw = sweep_raw(context_tokens=[16, 100, 120], max_new_tokens=[8], concurrency=[1], requests_per_point=3,
                    engine=managed_engine("--max-context", "64", grid={"max_batch": [4]}))
    config = write_config(tmp_path / "sweep.toml", raw)
    with OtlpReceiver() as rx:
        env = sweep_env(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=rx.endpoint,
                        OTEL_EXPORTER_OTLP_PROTOCOL="grpc", OTEL_BSP_SCHEDULE_DELAY="100")
        proc = run_sweep(config, tmp_path / "out", env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        # client: 1 sweep + 3 points + 4 requests; engine: 4 Decode spans (flushed when drained)
        rx.wait_for(lambda s: s.service == "bench-client", count=8)
        rx.wait_for(lambda s: s.service == "engine" and s.name == DECODE, count=4)
        spans = rx.spans()

    client = [s for s in spans if s.service == "bench-client"]
    engine_decodes = [s for s in spans if s.service == "engine" and s.name == DECODE]
    assert len({s.trace_id for s in spans}) == 1, "the whole sweep, both services, is one trace"

    [sweep] = [s for s in client if s.name == "bench.sweep"]
    assert sweep.parent_span_id == ""  # the root
    assert sweep.attributes["bench.sweep.end"] == "completed" and sweep.attributes["bench.sweep.recorded"] == 3

    points = {s.attributes["bench.point.context_tokens"]: s for s in client if s.name == "bench.point"}
    assert set(points) == {16, 100, 120}
    assert all(p.parent_span_id == sweep.span_id for p in points.values())
    ok = points[16].attributes
    assert ok["bench.point.max_new_tokens"] == 8 and ok["bench.point.concurrency"] == 1
    assert ok["bench.point.request_rate"] == "inf" and ok["bench.engine.max_batch"] == 4
    assert ok["bench.point.status"] == "ok" and ok["bench.point.requests.completed"] == 3

    requests = [s for s in client if s.name == DECODE]
    assert all(r.span.kind == r.span.SPAN_KIND_CLIENT for r in requests)
    assert {r.parent_span_id for r in requests} <= {p.span_id for p in points.values()}
    # each engine Decode span continues one client request span; a request without one was
    # cancelled by the client before the engine saw it (the refused point's queued requests)
    continued = {e.parent_span_id for e in engine_decodes}
    assert len(continued) == len(engine_decodes) and continued <= {r.span_id for r in requests}
    for r in requests:
        assert r.span_id in continued or r.attributes["rpc.grpc.status_code"] == CANCELLED, r.attributes
    requests = [r for r in requests if r.attributes["rpc.grpc.status_code"] != CANCELLED]

    served = by_parent(requests, points[16])
    assert len(served) == 3
    for r in served:
        attrs = r.attributes
        assert attrs["rpc.grpc.status_code"] == 0 and "error.type" not in attrs
        assert attrs["gen_ai.request.max_tokens"] == 8 and attrs["gen_ai.usage.output_tokens"] == 8
        assert attrs["gen_ai.usage.input_tokens"] == 16
        assert attrs["bench.request.warmup"] is False and attrs["bench.request.attempt"] == 1

    # the refused point: its one request shows the status and reason, and the skip its reason
    [rejected] = by_parent(requests, points[100])
    assert rejected.attributes["rpc.grpc.status_code"] == INVALID_ARGUMENT
    assert rejected.attributes["error.type"] == "CONTEXT_LENGTH_EXCEEDED"
    assert rejected.events["rpc_error"]["error.reason"] == "CONTEXT_LENGTH_EXCEEDED"
    assert rejected.span.status.code == rejected.span.status.STATUS_CODE_ERROR
    [engine_side] = [e for e in engine_decodes if e.parent_span_id == rejected.span_id]
    assert engine_side.attributes["error.type"] == "CONTEXT_LENGTH_EXCEEDED"
    for context, sent in ((100, True), (120, False)):
        attrs = points[context].attributes
        assert attrs["bench.point.status"] == "skipped" and attrs["bench.point.skipped"] is True
        assert attrs["bench.point.skip_reason"] == "CONTEXT_LENGTH_EXCEEDED"
        assert attrs["bench.point.skipped_without_sending"] is not sent
        assert points[context].events["point_skipped"]["error.metadata.maxContextTokens"] == "64"
    assert by_parent(requests, points[120]) == []  # nothing was sent for it


@pytest.mark.parametrize(("otel", "named"), [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
     "OTEL_EXPORTER_OTLP_PROTOCOL"),
])
def test_a_misconfigured_exporter_stops_the_sweep_before_any_request(tmp_path: Path, otel: dict[str, str],
                                                                     named: str) -> None:
    config = write_config(tmp_path / "sweep.toml", sweep_raw("127.0.0.1:1"))
    proc = run_sweep(config, tmp_path / "out", sweep_env(**otel))
    assert proc.returncode == 2 and named in proc.stderr
    assert not (tmp_path / "out").exists()
