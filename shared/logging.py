"""structlog set-up, called once from each process's main(): JSON lines when stderr is not a
TTY, the console renderer when it is; standard-library loggers come out the same way.

Every event logged while an OpenTelemetry span is current carries its `trace_id` and `span_id`.
Code that runs outside that context (the decode loop thread, or an async generator that holds a
span across yields) passes `request_id`, `trace_id` and `span_id` explicitly; those win.
Event names are documented in docs/events.md."""

from __future__ import annotations

import logging
import os
import sys

import structlog
from opentelemetry import trace

LEVEL_ENV = "LOG_LEVEL"

# Tracebacks without local variables: locals would put prompt and output tokens into the log.
_TRACEBACKS_WITHOUT_LOCALS = structlog.processors.ExceptionRenderer(
    structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
)


def add_trace_ids(_logger: object, _method: str, event_dict: dict) -> dict:
    """Add the current span's ids unless the event already names a trace."""
    if "trace_id" not in event_dict:
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            event_dict["trace_id"] = trace.format_trace_id(ctx.trace_id)
            event_dict["span_id"] = trace.format_span_id(ctx.span_id)
    return event_dict


def configure_logging(level: str | None = None, json: bool | None = None) -> None:
    """Configure structlog and the standard library's root logger, once per process. The level is
    `level`, else the LOG_LEVEL environment variable, else info."""
    if level is None:
        level = os.environ.get(LEVEL_ENV) or "info"
    if json is None:
        json = not sys.stderr.isatty()
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"log level must be one of debug, info, warning, error, critical, got {level!r}")
    shared = [
        structlog.contextvars.merge_contextvars,
        add_trace_ids,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            _TRACEBACKS_WITHOUT_LOCALS if json else structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
