"""One request's telemetry: its server span, and at its end, in one place, the `request_finished`
log event, the metrics and the span's outcome.

The span is started from the caller's W3C trace context (gRPC metadata) and is never made the
current span: Decode is an async generator that grpc.aio may close from another context, where a
context token could not be detached. Log events carry its ids explicitly instead (`log_ids`), and
the decode loop thread gets them through `Sequence.trace`. Queue wait, prefill and decode become
child spans at the end, rebuilt from the sequence's timings: nothing is traced per token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import grpc
import structlog
from opentelemetry import trace
from opentelemetry.context import Context

from engine_service.runtime.engine import Handle
from engine_service.scheduling.sequence import Timings
from engine_service.transport.metrics import EngineMetrics, RequestSample
from shared.errors import EngineError
from shared.tracing import log_ids, rpc_attributes, set_rpc_outcome

log = structlog.get_logger()

TRACER_NAME = "engine_service"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class RequestOutcome:
    """How one Decode ended; the fields after `started` are None where it never got that far."""

    request_id: str
    code: grpc.StatusCode
    error: EngineError | None
    started: float  # time.monotonic() when the handler began
    ended: float
    max_tokens: int | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    timings: Timings | None = None
    finish_reason: str | None = None
    model: str | None = None
    cached_prompt_tokens: int | None = None  # of prompt_tokens, those the prefix cache supplied
    draft_tokens: int = 0  # speculated tokens verified (--speculative)
    accepted_tokens: int = 0  # of those, accepted

    @classmethod
    def of(cls, request_id: str, code: grpc.StatusCode, error: EngineError | None, started: float,
           handle: Handle | None, finish: str | None, model: str | None) -> RequestOutcome:
        """How a request ended, now, with what its sequence says when it got one (either front)."""
        outcome = cls(request_id, code, error, started, time.monotonic(), finish_reason=finish,
                      max_tokens=handle.seq.request.max_new_tokens if handle is not None else None, model=model)
        if handle is None:
            return outcome
        seq = handle.seq
        return replace(outcome, prompt_tokens=len(seq.request.prompt_ids), output_tokens=len(seq.generated),
                       cached_prompt_tokens=seq.cached_tokens, timings=seq.timings,
                       draft_tokens=seq.controls.draft_tokens, accepted_tokens=seq.controls.accepted_tokens)

    @property
    def reason(self) -> str:
        return self.error.reason if self.error is not None else ""

    @property
    def ttft_s(self) -> float | None:
        t = self.timings
        return t.first_token - self.started if t is not None and t.first_token is not None else None

    @property
    def tpot_s(self) -> float | None:
        """(last token - first token) / (output tokens - 1), for a successful request of 2+ tokens."""
        t, n = self.timings, self.output_tokens or 0
        if self.code is not grpc.StatusCode.OK or n < 2 or t is None or t.first_token is None or t.last_token is None:
            return None
        return (t.last_token - t.first_token) / (n - 1)


class RequestTelemetry:
    def __init__(self, metrics: EngineMetrics, tracer: trace.Tracer | None = None) -> None:
        self.metrics = metrics
        self._tracer = tracer or trace.get_tracer(TRACER_NAME)  # the global provider's, set up in main()

    def start_span(self, method: str, parent: Context) -> trace.Span:
        return self._tracer.start_span(f"engine.v1.EngineService/{method}", context=parent,
                                       kind=trace.SpanKind.SERVER, attributes=rpc_attributes(method))

    def start_http_span(self, route: str, parent: Context) -> trace.Span:
        """The server span of a call to the HTTP front (`route`: its path), HTTP's semantic
        conventions' name and attributes; it ends as a Decode's does (`finish`), the status the
        request ended with as the gRPC code the same error has (`rpc.grpc.status_code`)."""
        return self._tracer.start_span(f"POST {route}", context=parent, kind=trace.SpanKind.SERVER,
                                       attributes={"http.request.method": "POST", "http.route": route})

    def finish(self, span: trace.Span, outcome: RequestOutcome) -> None:
        """The one place a request's end is told: log, metrics, span."""
        self._log(span, outcome)
        self.metrics.record(RequestSample(
            status=outcome.code.name, reason=outcome.reason, duration_s=outcome.ended - outcome.started,
            prompt_tokens=outcome.prompt_tokens, output_tokens=outcome.output_tokens, ttft_s=outcome.ttft_s,
            tpot_s=outcome.tpot_s, draft_tokens=outcome.draft_tokens, accepted_tokens=outcome.accepted_tokens))
        if span.is_recording():
            self._end_span(span, outcome)

    @staticmethod
    def _log(span: trace.Span, o: RequestOutcome) -> None:
        fields: dict[str, object] = {"request_id": o.request_id, **log_ids(span), "status": o.code.name,
                                     "duration_s": round(o.ended - o.started, 6)}
        if o.error is not None:
            fields["reason"] = o.error.reason
        if o.prompt_tokens is not None:
            fields.update(prompt_tokens=o.prompt_tokens, output_tokens=o.output_tokens,
                          cached_prompt_tokens=o.cached_prompt_tokens)
        t = o.timings
        if t is not None and t.prefill_started is not None:
            fields["queue_s"] = round(t.prefill_started - t.accepted, 6)
        if t is not None and t.first_token is not None:
            fields["ttft_s"] = round(t.first_token - t.accepted, 6)
        log.info("request_finished", **fields)

    def _end_span(self, span: trace.Span, o: RequestOutcome) -> None:
        attributes: dict[str, object] = {"gen_ai.operation.name": "text_completion"}
        if o.request_id:
            attributes["gen_ai.response.id"] = o.request_id
        if o.model is not None:
            attributes["gen_ai.request.model"] = o.model
        if o.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = o.max_tokens
        if o.prompt_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = o.prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = o.output_tokens or 0
            # the current GenAI semantic conventions' name (included in input_tokens, as they ask)
            attributes["gen_ai.usage.cache_read.input_tokens"] = o.cached_prompt_tokens or 0
        if o.finish_reason is not None:
            attributes["gen_ai.response.finish_reasons"] = (o.finish_reason,)
        span.set_attributes(attributes)  # type: ignore[arg-type]
        message = o.error.message if o.error is not None else ""
        set_rpc_outcome(span, o.code, o.reason, message, server=True)
        if o.timings is not None:
            self._phase_spans(span, o.timings, o.ended)
        span.end()

    def _phase_spans(self, span: trace.Span, t: Timings, ended: float) -> None:
        """queue_wait -> prefill (up to the first token) -> decode, from the sequence's timings."""
        offset = time.time_ns() - time.monotonic_ns()

        def ns(at: float) -> int:
            return int(at * 1e9) + offset

        parent = trace.set_span_in_context(span)
        phases = [("engine.queue_wait", t.accepted, t.prefill_started or ended)]
        if t.prefill_started is not None:
            phases.append(("engine.prefill", t.prefill_started, t.first_token or ended))
        if t.first_token is not None:
            phases.append(("engine.decode", t.first_token, t.last_token or ended))
        for name, start, end in phases:
            self._tracer.start_span(name, context=parent, start_time=ns(start)).end(end_time=ns(end))
        if t.first_token is not None:
            span.add_event("first_token", timestamp=ns(t.first_token))


def log_request_text(handle: Handle, tokenizer: Decoder, ids: dict[str, str]) -> None:
    """--log-text: a finished request's prompt and output text (debug only)."""
    seq = handle.seq
    log.info("request_text", request_id=seq.request_id, **ids,
             prompt_text=tokenizer.decode(list(seq.request.prompt_ids)), output_text=tokenizer.decode(seq.generated))
