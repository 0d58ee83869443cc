"""Metrics on hand-built timelines (vLLM bench-serve definitions: ITL per chunk, output tokens from usage)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench_client.metrics import Arrival, RequestTimeline, Summary, compute, percentile


def timeline(sent: float, *arrivals: tuple[float, int], prompt: int = 10, **engine: float) -> RequestTimeline:
    return RequestTimeline(sent_at=sent, arrivals=tuple(Arrival(t, k) for t, k in arrivals), prompt_tokens=prompt,
                           **engine)


def test_single_token_messages() -> None:
    t = timeline(1.0, (1.1, 1), (1.2, 1), (1.3, 1), (1.4, 1))
    assert t.output_tokens == 4
    assert t.ttft == pytest.approx(0.1)
    assert t.e2el == pytest.approx(0.4)
    assert t.tpot == pytest.approx(0.1)
    assert t.itls() == pytest.approx([0.1, 0.1, 0.1])


def test_message_with_several_tokens_is_one_itl_gap_and_tpot_is_per_token() -> None:
    # first message: 2 tokens at 0.1; second: 3 tokens at 0.4 -> 5 tokens, one gap between chunks (vLLM)
    t = timeline(0.0, (0.1, 2), (0.4, 3))
    assert t.output_tokens == 5 and t.output_token_source == "stream"
    assert t.ttft == pytest.approx(0.1)
    assert t.e2el == pytest.approx(0.4)
    assert t.tpot == pytest.approx(0.3 / 4)
    assert t.itls() == pytest.approx([0.3])
    assert sum(t.itls()) == pytest.approx(t.e2el - t.ttft)


def test_the_servers_usage_is_the_output_count() -> None:
    # llama-server's reproducer: 16 tokens in 14 events (two events carried two tokens); usage says 16
    arrivals = [(0.1 * (i + 1), 2 if i in (3, 9) else 1) for i in range(14)]
    t = timeline(0.0, *arrivals, usage_completion_tokens=16)
    assert (t.streamed_tokens, t.output_tokens, t.output_token_source) == (16, 16, "usage")
    one_each = timeline(0.0, *[(0.1 * (i + 1), 1) for i in range(14)], usage_completion_tokens=16)
    assert (one_each.streamed_tokens, one_each.output_tokens, one_each.usage_mismatch) == (14, 16, True)
    assert one_each.tpot == pytest.approx((1.4 - 0.1) / 15)  # per token of the server's count
    assert len(one_each.itls()) == 13
    # no usage: the tokenizer's count of the text, else the stream's
    counted = timeline(0.0, (0.1, 1), (0.2, 1), text_tokens=5)
    assert (counted.output_tokens, counted.output_token_source) == (5, "tokenizer")
    point = compute([t, one_each, counted, timeline(0.0, (0.1, 1))], duration_s=2.0)
    assert point.total_output_tokens == 16 + 16 + 5 + 1
    assert point.output_token_source == {"stream": 1, "tokenizer": 1, "usage": 2}


def test_goodput_and_attainment() -> None:
    @dataclasses.dataclass
    class Slo:
        ttft_ms: float | None = None
        tpot_ms: float | None = None
        e2el_ms: float | None = None

    fast = timeline(0.0, (0.1, 1), (0.2, 1))  # ttft 100, tpot 100, e2el 200 ms
    slow_start = timeline(0.0, (0.5, 1), (0.6, 1))  # ttft 500
    one_token = timeline(0.0, (0.1, 1))  # tpot counts as 0
    assert fast.meets(Slo(ttft_ms=100.0, tpot_ms=100.0, e2el_ms=200.0))  # the bounds are inclusive
    assert not fast.meets(Slo(tpot_ms=99.0)) and not fast.meets(Slo(e2el_ms=199.0))
    assert one_token.meets(Slo(tpot_ms=0.0)) and fast.meets(Slo())
    m = compute([fast, slow_start, one_token], duration_s=2.0, slo=Slo(ttft_ms=200.0), measured=4)
    assert (m.good_requests, m.request_goodput, m.slo_attainment) == (2, 1.0, 0.5)
    plain = compute([fast], duration_s=1.0)
    assert (plain.good_requests, plain.request_goodput, plain.slo_attainment) == (None, None, None)
    assert compute([], duration_s=1.0, slo=Slo(ttft_ms=1.0), measured=0).slo_attainment == 0.0
    with pytest.raises(ValueError, match="^measured must be >= the 1 successful requests, got 0$"):
        compute([fast], duration_s=1.0, slo=Slo(ttft_ms=1.0), measured=0)


def test_one_token_has_no_tpot_and_no_itl() -> None:
    t = timeline(0.0, (0.25, 1))
    assert t.ttft == pytest.approx(0.25) and t.e2el == pytest.approx(0.25)
    assert t.tpot is None
    assert t.itls() == []


def test_messages_without_tokens_are_ignored() -> None:
    # a final message carrying only finish_reason/usage does not move E2EL
    t = timeline(0.0, (0.1, 1), (0.2, 1), (0.9, 0))
    assert t.e2el == pytest.approx(0.2)
    assert t.output_tokens == 2


def test_percentile_matches_numpy_linear() -> None:
    values = sorted([5.0, 1.0, 9.0, 3.0, 7.5, 2.25, 8.0])
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    with pytest.raises(ValueError, match="^percentile of no values is undefined, got an empty sequence$"):
        percentile([], 50)
    with pytest.raises(ValueError, match="101"):
        percentile([1.0], 101)


def test_summary_in_milliseconds_and_empty() -> None:
    s = Summary.of([0.001, 0.002, 0.003, 0.004])
    assert s.mean == pytest.approx(2.5)
    assert s.median == pytest.approx(2.5)
    assert s.p90 == pytest.approx(float(np.percentile([1, 2, 3, 4], 90)))
    assert s.p99 == pytest.approx(float(np.percentile([1, 2, 3, 4], 99)))  # 3.97, not the maximum
    empty = Summary.of([])
    assert (empty.mean, empty.median, empty.p90, empty.p99, empty.std) == (None,) * 5
    assert empty.percentiles == {"50": None, "90": None, "95": None, "99": None}


def test_point_metrics_over_two_requests() -> None:
    a = timeline(0.0, (0.1, 1), (0.2, 1), (0.3, 1), prompt=100, engine_queue_s=0.01, engine_ttft_s=0.05)
    b = timeline(0.5, (0.7, 2), (1.0, 2), prompt=50, engine_queue_s=0.03, engine_ttft_s=0.15)
    m = compute([a, b], duration_s=2.0)
    assert (m.completed, m.duration_s) == (2, 2.0)
    assert m.total_input_tokens == 150 and m.total_output_tokens == 7
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(78.5)
    assert m.ttft_ms.mean == pytest.approx((100 + 200) / 2)
    assert m.e2el_ms.median == pytest.approx((300 + 500) / 2)
    # TPOT per request: a (0.3-0.1)/2 = 0.1; b (0.5-0.2)/3 = 0.1
    assert m.tpot_ms.mean == pytest.approx(100.0)
    # ITL per chunk: a [0.1, 0.1]; b [0.3]
    assert m.itl_ms.mean == pytest.approx(1000 * (0.1 + 0.1 + 0.3) / 3)
    assert m.engine_queue_ms.mean == pytest.approx(20.0)
    assert m.engine_ttft_ms.median == pytest.approx(100.0)


def test_no_successful_request() -> None:
    m = compute([], duration_s=1.0)
    assert m.completed == 0 and m.output_throughput == 0.0
    assert m.ttft_ms.mean is None
    with pytest.raises(ValueError, match="duration_s"):
        compute([], duration_s=-1.0)


@given(st.lists(st.tuples(st.floats(0.0001, 1.0), st.integers(1, 5)), min_size=1, max_size=30))
def test_itl_gaps_sum_to_e2el_minus_ttft(messages: list[tuple[float, int]]) -> None:
    now, arrivals = 0.0, []
    for gap, k in messages:
        now += gap
        arrivals.append((now, k))
    t = timeline(0.0, *arrivals)
    gaps = t.itls()
    assert len(gaps) == len(messages) - 1  # one gap between consecutive chunks
    assert math.isclose(sum(gaps), t.e2el - t.ttft, rel_tol=1e-9, abs_tol=1e-12)
    if t.tpot is not None:
        assert math.isclose(sum(gaps) / (t.output_tokens - 1), t.tpot, rel_tol=1e-9)


def test_throughput_over_short_and_zero_durations() -> None:
    one = [timeline(0.0, (0.1, 1), (0.2, 1), prompt=3)]
    half = compute(one, duration_s=0.5)
    assert (half.request_throughput, half.output_throughput, half.total_token_throughput) == pytest.approx(
        (2.0, 4.0, 10.0))
    # a point that took no measurable time has no throughput rather than a division by zero
    zero = compute(one, duration_s=0.0)
    assert (zero.request_throughput, zero.output_throughput, zero.total_token_throughput) == (0.0, 0.0, 0.0)
    assert zero.completed == 1


def test_as_dict_is_plain_nested_data() -> None:
    m = compute([timeline(0.0, (0.1, 1), (0.3, 1))], duration_s=1.0).as_dict()
    assert m["completed"] == 1 and m["duration_s"] == 1.0
    assert m["ttft_ms"] == {"mean": pytest.approx(100.0), "median": pytest.approx(100.0), "p90": pytest.approx(100.0),
                            "p99": pytest.approx(100.0), "std": 0.0,
                            "percentiles": {"50": pytest.approx(100.0), "90": pytest.approx(100.0),
                                            "95": pytest.approx(100.0), "99": pytest.approx(100.0)}}
    assert m["engine_queue_ms"] == {"mean": None, "median": None, "p90": None, "p99": None, "std": None,
                                    "percentiles": {"50": None, "90": None, "95": None, "99": None}}


def test_configured_percentiles_and_std() -> None:
    s = Summary.of([0.001, 0.002, 0.003, 0.004], percentiles=(25.0, 99.9))
    assert s.percentiles == {"25": pytest.approx(1.75), "99.9": pytest.approx(float(np.percentile([1, 2, 3, 4], 99.9)))}
    assert s.std == pytest.approx(float(np.std([1.0, 2.0, 3.0, 4.0])))
    assert (s.median, s.p90, s.p99) == (pytest.approx(2.5), pytest.approx(3.7), pytest.approx(3.97))


def test_cached_prompt_tokens_total_and_mean_per_completed_request() -> None:
    a = RequestTimeline(sent_at=0.0, arrivals=(Arrival(0.1, 1),), prompt_tokens=80, cached_prompt_tokens=64)
    b = RequestTimeline(sent_at=0.0, arrivals=(Arrival(0.1, 1),), prompt_tokens=80, cached_prompt_tokens=0)
    c = timeline(0.0, (0.1, 1), prompt=80)  # an engine that reports none: 0
    assert c.cached_prompt_tokens == 0
    m = compute([a, b, c], duration_s=1.0)
    assert m.total_cached_prompt_tokens == 64 and m.mean_cached_prompt_tokens == pytest.approx(64 / 3)
    assert m.total_input_tokens == 240  # cached tokens are part of the prompt tokens, not added to them
    empty = compute([], duration_s=1.0)
    assert empty.total_cached_prompt_tokens == 0 and empty.mean_cached_prompt_tokens is None
    assert compute([a], duration_s=1.0).as_dict()["mean_cached_prompt_tokens"] == 64.0


def test_the_servers_own_counts_and_timings_beside_the_clients() -> None:
    # found by `make mutate` (docs/mutation-testing.md): nothing read these figures back
    agrees = timeline(0.0, (0.1, 2), (0.2, 1), usage_completion_tokens=3,
                      server_timings={"prompt_ms": 10.0, "predicted_n": 3, "cache_n": True, "odd": math.nan,
                                      "name": "x"})
    differs = timeline(0.0, (0.1, 1), (0.2, 2), usage_completion_tokens=5,
                       server_timings={"prompt_ms": 20.0, "cache_n": 1})
    silent = timeline(0.0, (0.1, 1), (0.2, 2))
    assert (agrees.usage_mismatch, differs.usage_mismatch, silent.usage_mismatch) == (False, True, False)
    point = compute([agrees, differs, silent], duration_s=1.0)
    assert point.usage_mismatches == 1
    # the mean of each finite number over the reports that carry it; a bool, a NaN or a string is no figure
    assert point.server_timings_mean == {"cache_n": 1.0, "predicted_n": 3.0, "prompt_ms": 15.0}
    assert list(point.server_timings_mean) == ["cache_n", "predicted_n", "prompt_ms"]
    assert compute([silent], duration_s=1.0).server_timings_mean == {}


def test_every_summary_of_a_point_has_the_configured_percentiles() -> None:
    # found by `make mutate`: compute dropping `percentiles` for one summary passed every test
    a = timeline(0.0, (0.1, 1), (0.3, 1), (0.4, 1), engine_queue_s=0.01, engine_ttft_s=0.05)
    b = timeline(0.0, (0.2, 1), (0.6, 1), engine_queue_s=0.03, engine_ttft_s=0.15)
    m = compute([a, b], duration_s=1.0, percentiles=(0.0, 100.0))
    # ITL gaps (ms): a 200, 100; b 400. TPOT: a 150, b 400
    expected = {"ttft_ms": (100.0, 200.0), "tpot_ms": (150.0, 400.0), "itl_ms": (100.0, 400.0),
                "e2el_ms": (400.0, 600.0), "engine_queue_ms": (10.0, 30.0), "engine_ttft_ms": (50.0, 150.0)}
    for name, (low, high) in expected.items():
        summary = getattr(m, name)
        assert list(summary.percentiles) == ["0", "100"], name
        assert summary.percentiles["0"] == pytest.approx(low) and summary.percentiles["100"] == pytest.approx(high)
