"""OpenTelemetry tracing set-up and W3C trace context in gRPC metadata, shared by both services.

`configure_tracing` is called once from each process's main(). It reads the standard variables
(`OTEL_TRACES_EXPORTER`, `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`,
`OTEL_EXPORTER_OTLP_PROTOCOL`, `OTEL_SERVICE_NAME`; the SDK itself reads the `OTEL_BSP_*`,
`OTEL_TRACES_SAMPLER` and exporter details). Unlike the SDK's own default (OTLP to localhost), tracing
is OFF unless a variable asks for it: `OTEL_TRACES_EXPORTER` set to something other than `none`, or an
OTLP endpoint given. Off means no provider is installed: spans are the API's no-ops and nothing
touches the network.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

EXPORTERS = ("otlp", "console", "none")
PROTOCOLS = ("grpc", "http/protobuf")
_PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent/tracestate, whatever OTEL_PROPAGATORS says
# Codes that mark a SERVER span as failed (the RPC semantic conventions' list, plus ABORTED: for
# this engine a sequence that failed mid-decode is the server's failure). A client span fails on
# every code but OK.
SERVER_ERROR_CODES = frozenset({
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.ABORTED,
})


@dataclass(frozen=True)
class TracingSettings:
    """What the environment asks for; `exporters` is empty when tracing is off."""

    exporters: tuple[str, ...]
    protocol: str = "grpc"

    @property
    def enabled(self) -> bool:
        return bool(self.exporters)


def settings_from_env(env: Mapping[str, str]) -> TracingSettings:
    """Decide from the variables; raises ValueError naming the variable and its value."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return TracingSettings(())
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip()
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    raw = env.get("OTEL_TRACES_EXPORTER", "").strip()
    if raw:
        names = tuple(n.strip() for n in raw.split(",") if n.strip())
        unknown = [n for n in names if n not in EXPORTERS]
        if unknown:
            raise ValueError(f"OTEL_TRACES_EXPORTER must be a comma-separated list of {', '.join(EXPORTERS)}, "
                             f"got {raw!r}")
        return TracingSettings(tuple(n for n in names if n != "none"), protocol)
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return TracingSettings(("otlp",), protocol)
    return TracingSettings((), protocol)


def configure_tracing(default_service_name: str, env: Mapping[str, str] | None = None) -> TracerProvider | None:
    """Install the global TracerProvider the environment asks for, or none at all (the default).
    Call once from main(); raises ValueError on a misconfiguration, naming the variable."""
    settings = settings_from_env(os.environ if env is None else env)
    if not settings.enabled:
        return None
    exporters = [_exporter(name, settings.protocol) for name in settings.exporters]
    provider = TracerProvider(resource=service_resource(default_service_name))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


def service_resource(default_service_name: str) -> Resource:
    """The process's resource: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES when set, else
    `service.name` = `default_service_name`."""
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
    return resource


def _exporter(name: str, protocol: str) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def flush_traces(timeout_s: float = 1.0) -> None:
    """Export the spans ended so far (before a fast exit); a no-op when tracing is off."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.force_flush(int(timeout_s * 1000))


def shutdown_tracing() -> None:
    """Flush and stop the exporters; call once at the end of main(). A no-op when tracing is off."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


# -- propagation in gRPC metadata --------------------------------------------------------------

def inject_metadata(metadata: Iterable[tuple[str, str]] = (), context: otel_context.Context | None = None
                    ) -> list[tuple[str, str]]:
    """`metadata` plus `traceparent` (and `tracestate`) of the current span, or of `context`'s.
    Pass the result as a call's `metadata=`; unchanged when no span is active."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return [*metadata, *carrier.items()]


def extract_context(metadata: Sequence[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The caller's trace context from a call's invocation metadata (an empty context if none)."""
    carrier = {key: value for key, value in (metadata or ()) if isinstance(value, str)}
    return _PROPAGATOR.extract(carrier)


# -- ids for log events ------------------------------------------------------------------------

def log_ids(span: trace.Span | None = None) -> dict[str, str]:
    """`trace_id` and `span_id` (hex, as in W3C traceparent) of `span` or of the current span;
    empty when none is recording a valid context. Bind them to log events inside a request, and
    carry them explicitly to other threads (contextvars do not cross threads)."""
    ctx = (span if span is not None else trace.get_current_span()).get_span_context()
    if not ctx.is_valid:
        return {}
    return {"trace_id": trace.format_trace_id(ctx.trace_id), "span_id": trace.format_span_id(ctx.span_id)}


# -- span attributes shared by both sides ------------------------------------------------------

def rpc_attributes(method: str, service: str = "engine.v1.EngineService") -> dict[str, str]:
    """The RPC semantic conventions' attributes of a call to `service`/`method`."""
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


def set_rpc_outcome(span: trace.Span, code: grpc.StatusCode, reason: str = "", message: str = "", *,
                    server: bool) -> None:
    """Put a call's final status on its span: `rpc.grpc.status_code`, and for a failure `error.type`
    (the ErrorInfo reason, or the code's name when there is none), an `rpc_error` event with code,
    reason and message, and ERROR status where the conventions call the code a failure."""
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is grpc.StatusCode.OK:
        return
    span.set_attribute("error.type", reason or code.name)
    span.add_event("rpc_error", {"rpc.grpc.status": code.name, "error.reason": reason, "error.message": message})
    if not server or code in SERVER_ERROR_CODES:
        span.set_status(Status(StatusCode.ERROR, f"{code.name} {reason}: {message}" if reason else code.name))


def record_skip(span: trace.Span, reason: str, metadata: Mapping[str, str] | None = None) -> None:
    """Mark a sweep point's span as skipped, with the server's reason and metadata."""
    span.set_attribute("bench.point.skipped", True)
    span.set_attribute("bench.point.skip_reason", reason)
    span.add_event("point_skipped", {"error.reason": reason, **{f"error.metadata.{k}": v for k, v in (metadata or {}).items()}})
