"""Latency and throughput metrics, defined as vLLM's `bench serve` defines them.

Over successful requests only (failed ones are counted by the caller, by status code):
- TTFT = arrival of the first token - request sent.
- E2EL = arrival of the last token - request sent.
- TPOT = (E2EL - TTFT) / (output_tokens - 1), per request with at least two tokens.
- ITL = the gaps between consecutive *tokens*. A message carrying k tokens that arrives t seconds
  after the previous message counts as k gaps of t/k each. The tokens that share the first message
  with the first token arrived with it: they count as gaps of 0. So a request's ITL gaps number
  output_tokens - 1 and sum to E2EL - TTFT, and their mean is its TPOT.
- request throughput = completed requests / point duration; output throughput = sum of output
  tokens / duration; total token throughput = (sum of prompt + output tokens) / duration.
- cached prompt tokens: the prompt tokens whose KV the engine took from its prefix cache, as it
  reports them (Usage.cached_prompt_tokens; llama-server's cached_tokens; 0 from a server without
  one): their total and their mean per completed request. They are part of the prompt tokens.
- the server's own view, beside the client's: the requests whose usage block counts other output
  tokens than the stream carried (`usage_mismatches`), and the mean of each figure the server
  reported per request (`server_timings_mean`, from llama-server's `timings`).
Each latency is summarised by mean, median, p90 and p99 (linear interpolation, as numpy's
default), in milliseconds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class Arrival:
    """One streamed message: when it arrived (seconds, any monotonic clock) and its token count."""

    at: float
    num_tokens: int


@dataclass(frozen=True)
class RequestTimeline:
    """A successful request as the client saw it, plus the engine's own timing if it sent one."""

    sent_at: float
    arrivals: tuple[Arrival, ...]
    prompt_tokens: int
    engine_queue_s: float | None = None
    engine_ttft_s: float | None = None
    cached_prompt_tokens: int = 0  # of prompt_tokens, those the engine's prefix cache supplied
    usage_completion_tokens: int | None = None  # the server's own count (its usage block), when it sent one
    server_timings: Mapping[str, float] | None = None  # the server's own view (llama-server's `timings`)

    @property
    def usage_mismatch(self) -> bool:
        """The server's usage counts other output tokens than the client counted in its stream."""
        return self.usage_completion_tokens is not None and self.usage_completion_tokens != self.output_tokens

    @property
    def output_tokens(self) -> int:
        return sum(a.num_tokens for a in self.arrivals)

    def _token_arrivals(self) -> list[Arrival]:
        return [a for a in self.arrivals if a.num_tokens > 0]

    @property
    def ttft(self) -> float | None:
        arrivals = self._token_arrivals()
        return arrivals[0].at - self.sent_at if arrivals else None

    @property
    def e2el(self) -> float | None:
        arrivals = self._token_arrivals()
        return arrivals[-1].at - self.sent_at if arrivals else None

    @property
    def tpot(self) -> float | None:
        ttft, e2el, n = self.ttft, self.e2el, self.output_tokens
        if ttft is None or e2el is None or n < 2:
            return None
        return (e2el - ttft) / (n - 1)

    def itls(self) -> list[float]:
        """The n - 1 gaps between this request's n tokens (see the module docstring)."""
        arrivals = self._token_arrivals()
        if not arrivals:
            return []
        gaps = [0.0] * (arrivals[0].num_tokens - 1)
        previous = arrivals[0].at
        for arrival in arrivals[1:]:
            gaps.extend([(arrival.at - previous) / arrival.num_tokens] * arrival.num_tokens)
            previous = arrival.at
        return gaps


@dataclass(frozen=True)
class Summary:
    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values_s: Iterable[float]) -> Summary:
        """Summary of values in seconds, reported in milliseconds."""
        ms = sorted(v * 1000.0 for v in values_s)
        if not ms:
            return cls(None, None, None, None)
        return cls(statistics.fmean(ms), percentile(ms, 50.0), percentile(ms, 90.0), percentile(ms, 99.0))


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, interpolating linearly (numpy's default)."""
    if not sorted_values:
        raise ValueError("percentile of no values is undefined, got an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q!r}")
    position = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


@dataclass(frozen=True)
class PointMetrics:
    completed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_prompt_tokens: int
    mean_cached_prompt_tokens: float | None  # per completed request; None when none completed
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Summary
    tpot_ms: Summary
    itl_ms: Summary
    e2el_ms: Summary
    engine_queue_ms: Summary
    engine_ttft_ms: Summary
    # completed requests whose server-reported completion tokens differ from the tokens counted
    usage_mismatches: int = 0
    # the mean of each number the server reported about its requests (llama-server's `timings`:
    # prompt_n, prompt_ms, cache_n, predicted_n, predicted_ms, ...), over the requests that reported it
    server_timings_mean: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def compute(timelines: Sequence[RequestTimeline], duration_s: float) -> PointMetrics:
    """Metrics of one point from its successful requests and its duration (first send to last token)."""
    if duration_s < 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s!r}")
    input_tokens = sum(t.prompt_tokens for t in timelines)
    output_tokens = sum(t.output_tokens for t in timelines)
    cached_tokens = sum(t.cached_prompt_tokens for t in timelines)

    def per_second(amount: float) -> float:
        return amount / duration_s if duration_s > 0 else 0.0

    return PointMetrics(
        completed=len(timelines),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        total_cached_prompt_tokens=cached_tokens,
        mean_cached_prompt_tokens=cached_tokens / len(timelines) if timelines else None,
        request_throughput=per_second(len(timelines)),
        output_throughput=per_second(output_tokens),
        total_token_throughput=per_second(input_tokens + output_tokens),
        ttft_ms=Summary.of(v for t in timelines if (v := t.ttft) is not None),
        tpot_ms=Summary.of(v for t in timelines if (v := t.tpot) is not None),
        itl_ms=Summary.of(gap for t in timelines for gap in t.itls()),
        e2el_ms=Summary.of(v for t in timelines if (v := t.e2el) is not None),
        engine_queue_ms=Summary.of(v for t in timelines if (v := t.engine_queue_s) is not None),
        engine_ttft_ms=Summary.of(v for t in timelines if (v := t.engine_ttft_s) is not None),
        usage_mismatches=sum(1 for t in timelines if t.usage_mismatch),
        server_timings_mean=_means(t.server_timings for t in timelines if t.server_timings),
    )


def _means(reports: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The mean of each numeric key over the reports that carry it."""
    values: dict[str, list[float]] = {}
    for report in reports:
        for key, value in report.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                values.setdefault(key, []).append(float(value))
    return {key: statistics.fmean(items) for key, items in sorted(values.items())}
