"""Engine metrics through the OpenTelemetry SDK, served to Prometheus on `--metrics-port` (off by default).

Recorded in one place, once per request, when the servicer finishes it (`EngineMetrics.record`);
the load gauges are read from `Engine.load()` at scrape time. Prometheus names (the exporter turns
dots into underscores, adds `_total` to counters and the unit to histograms) are listed in README.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Meter, NoOpMeterProvider, Observation
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry, start_http_server

from engine_service.scheduling.scheduler import LoadSnapshot
from shared.tracing import service_resource

# Bucket boundaries advised by the GenAI semantic conventions for these two histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5)
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(frozen=True)
class RequestSample:
    """What one finished request contributes; None where the request never got that far."""

    status: str  # the final gRPC status code's name
    reason: str  # the ErrorInfo reason, "" when OK or when there is none (CANCELLED)
    duration_s: float
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0


class EngineMetrics:
    """The engine's instruments on `meter` (a no-op meter when metrics are off)."""

    def __init__(self, meter: Meter, load: Callable[[], LoadSnapshot], waiting: Callable[[], int]) -> None:
        self._load, self._waiting = load, waiting
        self.requests = meter.create_counter(
            "engine.requests", unit="{request}", description="Finished requests by final gRPC status and ErrorInfo reason")
        self.prompt_tokens = meter.create_counter(
            "engine.prompt_tokens", unit="{token}", description="Prompt tokens of requests the engine accepted")
        self.generation_tokens = meter.create_counter(
            "engine.generation_tokens", unit="{token}", description="Tokens generated (streamed or not)")
        # vLLM's spec_decode_num_draft_tokens / spec_decode_num_accepted_tokens
        self.draft_tokens = meter.create_counter(
            "engine.spec_decode.draft_tokens", unit="{token}",
            description="Speculated draft tokens verified (--speculative), counted when their request ends")
        self.accepted_tokens = meter.create_counter(
            "engine.spec_decode.accepted_tokens", unit="{token}",
            description="Of the draft tokens verified, those the model accepted")
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s", description="Time from request received to first token",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s",
            description="Time per output token after the first, per successful request",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS)
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration", unit="s", description="Time from request received to its final status",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        meter.create_observable_gauge("engine.queue.depth", [self._observe_waiting], unit="{request}",
                                      description="Requests waiting for a batch row")
        meter.create_observable_gauge("engine.batch.size", [self._observe_running], unit="{sequence}",
                                      description="Sequences in the running batch")
        meter.create_observable_gauge("engine.kv_cache.used_tokens", [self._observe_kv_used], unit="{token}",
                                      description="KV cache slots holding tokens")
        meter.create_observable_gauge("engine.kv_cache.usage", [self._observe_kv_usage], unit="1",
                                      description="Fraction of the KV cache in use (0..1)")
        # vLLM's prefix_cache_queries / prefix_cache_hits: prompt tokens looked up, and of those found
        meter.create_observable_counter("engine.prefix_cache.queries", [self._observe_prefix_queries],
                                        unit="{token}", description="Prompt tokens looked up in the prefix cache")
        meter.create_observable_counter("engine.prefix_cache.hits", [self._observe_prefix_hits], unit="{token}",
                                        description="Prompt tokens whose keys and values the prefix cache supplied")
        meter.create_observable_gauge("engine.prefix_cache.used_tokens", [self._observe_prefix_used],
                                      unit="{token}", description="Tokens of keys and values in the prefix cache")
        meter.create_observable_gauge("engine.prefix_cache.usage", [self._observe_prefix_usage], unit="1",
                                      description="Fraction of the prefix cache in use (0..1; 0 when it is off)")

    def record(self, sample: RequestSample) -> None:
        self.requests.add(1, {"status": sample.status, "reason": sample.reason})
        self.duration.record(sample.duration_s, {"status": sample.status})
        if sample.prompt_tokens is not None:
            self.prompt_tokens.add(sample.prompt_tokens)
        if sample.output_tokens:
            self.generation_tokens.add(sample.output_tokens)
        if sample.draft_tokens:
            self.draft_tokens.add(sample.draft_tokens)
            self.accepted_tokens.add(sample.accepted_tokens)
        if sample.ttft_s is not None:
            self.ttft.record(sample.ttft_s)
        if sample.tpot_s is not None:
            self.tpot.record(sample.tpot_s)

    # Gauge callbacks run on the scraping thread; they read the snapshot the loop publishes each step.
    def _observe_waiting(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._waiting())]

    def _observe_running(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._load().running_sequences)]

    def _observe_kv_used(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._load().kv_cache_used_tokens)]

    def _observe_kv_usage(self, _options: CallbackOptions) -> Iterable[Observation]:
        load = self._load()
        capacity = load.kv_cache_capacity_tokens
        return [Observation(load.kv_cache_used_tokens / capacity if capacity else 0.0)]

    def _observe_prefix_queries(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._load().prefix_cache.queried_tokens)]

    def _observe_prefix_hits(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._load().prefix_cache.hit_tokens)]

    def _observe_prefix_used(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._load().prefix_cache.used_tokens)]

    def _observe_prefix_usage(self, _options: CallbackOptions) -> Iterable[Observation]:
        stats = self._load().prefix_cache
        return [Observation(stats.used_tokens / stats.capacity_tokens if stats.capacity_tokens else 0.0)]


@dataclass
class MetricsServer:
    """The Prometheus endpoint: `http://HOST:PORT/metrics`."""

    port: int
    _provider: MeterProvider
    _httpd: object

    def stop(self) -> None:
        self._httpd.shutdown()  # type: ignore[attr-defined]
        self._provider.shutdown()


def disabled_meter() -> Meter:
    return NoOpMeterProvider().get_meter("engine_service")


def start_metrics_server(host: str, port: int) -> tuple[Meter, MetricsServer]:
    """A MeterProvider whose metrics a Prometheus endpoint on `host:port` serves (port 0: any free
    port, see `MetricsServer.port`). Raises OSError when the port cannot be bound."""
    registry = CollectorRegistry(auto_describe=True)
    reader = PrometheusMetricReader(registry=registry)
    provider = MeterProvider(metric_readers=[reader], resource=service_resource("engine"))
    try:
        httpd, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as err:
        provider.shutdown()
        raise OSError(f"could not serve metrics on {host}:{port}: {err}") from err
    return provider.get_meter("engine_service"), MetricsServer(httpd.server_port, provider, httpd)
