"""Latency and throughput metrics, defined as vLLM's `bench serve` defines them.

Over successful requests only (failed ones are counted by the caller, by status code):
- output tokens: the server's own count (`usage.completion_tokens`) where it reports one; else the
  count of the answer's text by the sweep's tokenizer; else the tokens the stream carried (one per
  event of a server that says nothing). One event may carry several tokens (llama-server does), so a
  count of events is never taken for the server's count. `output_token_source` says which, per point.
- TTFT = arrival of the first chunk that carries content - request sent.
- E2EL = arrival of the last content chunk - request sent.
- TPOT = (E2EL - TTFT) / (output_tokens - 1), per request with at least two tokens.
- ITL = the gaps between consecutive content chunks, as vLLM measures it (one gap per streamed
  chunk, whatever number of tokens it carried): so a server that streams several tokens an event
  shows its ITL as the user sees it, and its TPOT (from the token count) stays per token.
- request throughput = completed requests / point duration; output throughput = sum of output
  tokens / duration; total token throughput = (sum of prompt + output tokens) / duration.
- goodput (with SLOs, vLLM's `--goodput`): the completed requests whose TTFT, TPOT and E2EL are each
  within the SLO set for it (a one-token answer's TPOT is 0), per second of the point;
  `slo_attainment` = those requests / all measured requests (failed ones miss the SLO).
- cached prompt tokens: the prompt tokens whose KV the engine took from its prefix cache, as it
  reports them (Usage.cached_prompt_tokens; llama-server's cached_tokens; 0 from a server without
  one): their total and their mean per completed request. They are part of the prompt tokens.
- the server's own view, beside the client's: the requests whose usage block counts other output
  tokens than the stream's events carried (`usage_mismatches`, a diagnostic: llama-server's events
  may carry several tokens), and the mean of each figure the server reported per request
  (`server_timings_mean`, from llama-server's `timings`).
Each latency is summarised by mean, median, std (population, as numpy's default), p90, p99 and the
configured percentiles (linear interpolation, as numpy's default), in milliseconds.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

PERCENTILES = (50.0, 90.0, 95.0, 99.0)
USAGE, TOKENIZER, STREAM = "usage", "tokenizer", "stream"


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
    text_tokens: int | None = None  # the answer's text counted by the sweep's tokenizer (where no usage came)

    @property
    def usage_mismatch(self) -> bool:
        """The server's usage counts other output tokens than the stream's events carried."""
        return self.usage_completion_tokens is not None and self.usage_completion_tokens != self.streamed_tokens

    @property
    def streamed_tokens(self) -> int:
        """The tokens the stream's messages said they carried (an OpenAI event: one, or its logprobs)."""
        return sum(a.num_tokens for a in self.arrivals)

    @property
    def output_token_source(self) -> str:
        if self.usage_completion_tokens is not None:
            return USAGE
        return TOKENIZER if self.text_tokens is not None else STREAM

    @property
    def output_tokens(self) -> int:
        """The answer's length: the server's count, else the tokenizer's, else the stream's."""
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return self.text_tokens if self.text_tokens is not None else self.streamed_tokens

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
        """The gaps between this request's consecutive content chunks (vLLM's ITL)."""
        arrivals = self._token_arrivals()
        return [later.at - earlier.at for earlier, later in itertools.pairwise(arrivals)]

    def meets(self, slo: SLO) -> bool:
        """Every objective set in `slo` holds for this request (a one-token answer's TPOT is 0)."""
        checks = ((slo.ttft_ms, self.ttft), (slo.tpot_ms, self.tpot if self.tpot is not None else 0.0),
                  (slo.e2el_ms, self.e2el))
        return all(value is not None and value * 1000.0 <= bound for bound, value in checks if bound is not None)


class SLO(Protocol):
    ttft_ms: float | None
    tpot_ms: float | None
    e2el_ms: float | None


@dataclass(frozen=True)
class Summary:
    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None
    std: float | None = None
    percentiles: dict[str, float | None] = field(default_factory=dict)  # f"{q:g}" -> value

    @classmethod
    def of(cls, values_s: Iterable[float], percentiles: Sequence[float] = PERCENTILES) -> Summary:
        """Summary of values in seconds, reported in milliseconds."""
        ms = sorted(v * 1000.0 for v in values_s)
        if not ms:
            return cls(None, None, None, None, None, {f"{q:g}": None for q in percentiles})
        return cls(statistics.fmean(ms), percentile(ms, 50.0), percentile(ms, 90.0), percentile(ms, 99.0),
                   statistics.pstdev(ms), {f"{q:g}": percentile(ms, q) for q in percentiles})


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
    # where the output counts came from: {"usage": n, "tokenizer": n, "stream": n} requests
    output_token_source: dict[str, int] = field(default_factory=dict)
    good_requests: int | None = None  # with SLOs: the completed requests meeting every one
    request_goodput: float | None = None  # good_requests / duration
    slo_attainment: float | None = None  # good_requests / measured requests (failed ones included)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def compute(timelines: Sequence[RequestTimeline], duration_s: float, *, percentiles: Sequence[float] = PERCENTILES,
            slo: SLO | None = None, measured: int | None = None) -> PointMetrics:
    """Metrics of one point from its successful requests and its duration (first send to last token).
    With `slo`, goodput and attainment over `measured` requests (default: the successful ones)."""
    if duration_s < 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s!r}")
    measured = len(timelines) if measured is None else measured
    if measured < len(timelines):
        raise ValueError(f"measured must be >= the {len(timelines)} successful requests, got {measured!r}")
    input_tokens = sum(t.prompt_tokens for t in timelines)
    output_tokens = sum(t.output_tokens for t in timelines)
    cached_tokens = sum(t.cached_prompt_tokens for t in timelines)
    good = sum(1 for t in timelines if t.meets(slo)) if slo is not None else None

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
        ttft_ms=Summary.of((v for t in timelines if (v := t.ttft) is not None), percentiles),
        tpot_ms=Summary.of((v for t in timelines if (v := t.tpot) is not None), percentiles),
        itl_ms=Summary.of((gap for t in timelines for gap in t.itls()), percentiles),
        e2el_ms=Summary.of((v for t in timelines if (v := t.e2el) is not None), percentiles),
        engine_queue_ms=Summary.of((v for t in timelines if (v := t.engine_queue_s) is not None), percentiles),
        engine_ttft_ms=Summary.of((v for t in timelines if (v := t.engine_ttft_s) is not None), percentiles),
        usage_mismatches=sum(1 for t in timelines if t.usage_mismatch),
        server_timings_mean=_means(t.server_timings for t in timelines if t.server_timings),
        output_token_source=dict(sorted(Counter(t.output_token_source for t in timelines).items())),
        good_requests=good,
        request_goodput=per_second(good) if good is not None else None,
        slo_attainment=(good / measured if measured else 0.0) if good is not None else None,
    )


def _means(reports: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The mean of each numeric key over the reports that carry it."""
    values: dict[str, list[float]] = {}
    for report in reports:
        for key, value in report.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                values.setdefault(key, []).append(float(value))
    return {key: statistics.fmean(items) for key, items in sorted(values.items())}
