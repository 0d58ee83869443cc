"""deploy/otlp_sink.py, the compose drill's stand-in for Jaeger: exports arriving on several threads
at once each log one whole JSON line, and the last line's totals count every span."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from concurrent.futures import ThreadPoolExecutor

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from tests.engines import ROOT

_spec = importlib.util.spec_from_file_location("otlp_sink", ROOT / "deploy" / "otlp_sink.py")
assert _spec is not None and _spec.loader is not None
otlp_sink = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(otlp_sink)


def _export(service: str, spans: int) -> trace_service_pb2.ExportTraceServiceRequest:
    name = common_pb2.KeyValue(key="service.name", value=common_pb2.AnyValue(string_value=service))
    return trace_service_pb2.ExportTraceServiceRequest(resource_spans=[trace_pb2.ResourceSpans(
        resource=resource_pb2.Resource(attributes=[name]),
        scope_spans=[trace_pb2.ScopeSpans(spans=[trace_pb2.Span(name="s") for _ in range(spans)])])])


def test_concurrent_exports_each_log_one_whole_line_with_running_totals() -> None:
    sink = otlp_sink.CountingTraceService()
    out = io.StringIO()
    requests = [_export("engine" if i % 2 else "bench-client", 1 + i % 3) for i in range(400)]
    with contextlib.redirect_stdout(out), ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda r: sink.Export(r, None), requests))
    lines = out.getvalue().splitlines()
    assert len(lines) == 400
    records = [json.loads(line) for line in lines]  # one object a line: none torn, none doubled
    assert [r["event"] for r in records] == ["otlp_spans"] * 400
    expected = {"engine": sum(1 + i % 3 for i in range(1, 400, 2)), "bench-client": sum(1 + i % 3 for i in range(0, 400, 2))}
    assert records[-1]["totals"] == expected  # the lines come in the order of the totals
    assert sum(r["received"] for r in records) == sum(expected.values())
