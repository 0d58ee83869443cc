"""structlog set-up, called once from each process's main(): JSON lines when stderr is not a
TTY, the console renderer when it is; standard-library loggers come out the same way."""

from __future__ import annotations

import logging
import sys

import structlog

# Tracebacks without local variables: locals would put prompt and output tokens into the log.
_TRACEBACKS_WITHOUT_LOCALS = structlog.processors.ExceptionRenderer(
    structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
)


def configure_logging(level: str = "info", json: bool | None = None) -> None:
    """Configure structlog and the standard library's root logger, once per process."""
    if json is None:
        json = not sys.stderr.isatty()
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"log level must be one of debug, info, warning, error, critical, got {level!r}")
    shared = [
        structlog.contextvars.merge_contextvars,
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
