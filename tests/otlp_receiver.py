"""A real OTLP/gRPC trace receiver for tests: the collector's TraceService from opentelemetry-proto,
on a loopback port, keeping every span it is sent."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    span: trace_pb2.Span

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_span_id(self) -> str:
        return self.span.parent_span_id.hex()

    @property
    def attributes(self) -> dict[str, object]:
        return {kv.key: _value(kv.value) for kv in self.span.attributes}

    @property
    def events(self) -> dict[str, dict[str, object]]:
        return {e.name: {kv.key: _value(kv.value) for kv in e.attributes} for e in self.span.events}


def _value(v: common_pb2.AnyValue) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request, context):  # type: ignore[no-untyped-def]
        spans = []
        for rs in request.resource_spans:
            service = next((kv.value.string_value for kv in rs.resource.attributes if kv.key == "service.name"), "")
            spans += [ReceivedSpan(service, s) for ss in rs.scope_spans for s in ss.spans]
        with self.receiver._lock:
            self.receiver._spans.extend(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """`with OtlpReceiver() as rx:` then point OTEL_EXPORTER_OTLP_ENDPOINT at `rx.endpoint`."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, predicate: Callable[[ReceivedSpan], bool], count: int = 1, timeout: float = 15.0
                 ) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while True:
            found = [s for s in self.spans() if predicate(s)]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(0)
