"""The SLO search's bisection (slo_search.py), pure: the probes it asks for, and its answer."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench_client.config import CONCURRENCY, REQUEST_RATE, SearchConfig
from bench_client.slo_search import Probe, next_probe, result_of


def run(search: SearchConfig, capacity: float) -> list[Probe]:
    """The probes of a search against a server that meets the SLOs at any load <= capacity."""
    probes: list[Probe] = []
    while (value := next_probe(search, probes)) is not None:
        probes.append(Probe(value, 1.0 if value <= capacity else 0.5))
    return probes


def test_high_first_then_low_then_the_geometric_middle() -> None:
    search = SearchConfig(over=REQUEST_RATE, low=1.0, high=16.0, steps=6, attainment=0.9)
    probes = run(search, capacity=5.0)
    assert [p.value for p in probes] == [16.0, 1.0, 4.0, 8.0, 5.657, 4.757]
    result = result_of(search, probes)
    assert (result.best, result.first_miss, result.probes) == (4.757, 5.657, 6)


def test_met_at_high_ends_at_once_and_missed_at_low_after_two() -> None:
    search = SearchConfig(over=REQUEST_RATE, low=1.0, high=16.0, steps=6)
    assert [p.value for p in run(search, capacity=100.0)] == [16.0]
    assert result_of(search, run(search, capacity=100.0)).best == 16.0
    below = run(search, capacity=0.5)
    assert [p.value for p in below] == [16.0, 1.0]
    assert (result_of(search, below).best, result_of(search, below).first_miss) == (None, 1.0)


def test_concurrency_bisects_integers_until_adjacent() -> None:
    search = SearchConfig(over=CONCURRENCY, low=1, high=32, steps=20)
    probes = run(search, capacity=11)
    assert [p.value for p in probes] == [32.0, 1.0, 16.0, 8.0, 12.0, 10.0, 11.0]
    assert (result_of(search, probes).best, result_of(search, probes).first_miss) == (11.0, 12.0)


def test_the_attainment_target_is_inclusive() -> None:
    search = SearchConfig(over=REQUEST_RATE, low=1.0, high=2.0, steps=2, attainment=0.9)
    assert next_probe(search, [Probe(2.0, 0.9)]) is None  # met at high
    assert next_probe(search, [Probe(2.0, 0.8999)]) == 1.0


@given(capacity=st.floats(0.6, 20.0), steps=st.integers(2, 12))
def test_bounded_and_the_answer_is_a_met_probe_below_every_miss(capacity: float, steps: int) -> None:
    search = SearchConfig(over=REQUEST_RATE, low=1.0, high=16.0, steps=steps)
    probes = run(search, capacity)
    assert 1 <= len(probes) <= steps
    result = result_of(search, probes)
    if result.best is not None:
        assert result.best <= capacity
        assert all(p.value > result.best for p in probes if not p.meets(search.attainment))
    if result.first_miss is not None:
        assert result.first_miss > capacity


@pytest.mark.parametrize("done", [[Probe(16.0, 1.0)], [Probe(16.0, 0.0), Probe(1.0, 0.0)]])
def test_a_finished_search_asks_for_nothing(done: list[Probe]) -> None:
    assert next_probe(SearchConfig(over=REQUEST_RATE, low=1.0, high=16.0), done) is None


# Found by mutation testing (docs/mutation-testing.md).


def test_a_middle_that_rounds_to_the_first_miss_ends_the_search() -> None:
    search = SearchConfig(over=REQUEST_RATE, low=9.9991, high=10.0, steps=6)
    # sqrt(9.9991 * 10) = 9.99955, which 4 significant digits make 10: nothing left between
    assert next_probe(search, [Probe(10.0, 0.5), Probe(9.9991, 1.0)]) is None


def test_the_first_miss_is_above_the_best() -> None:
    search = SearchConfig(over=REQUEST_RATE, low=1.0, high=16.0, steps=6)
    # a server that missed at 4 but met at 8 (noise): the misses below the best do not count
    result = result_of(search, [Probe(16.0, 0.5), Probe(1.0, 1.0), Probe(4.0, 0.5), Probe(8.0, 1.0)])
    assert (result.best, result.first_miss, result.probes) == (8.0, 16.0, 4)
    # a value that met once and missed once is the best, not a miss above it
    result = result_of(search, [Probe(16.0, 0.5), Probe(1.0, 1.0), Probe(4.0, 1.0), Probe(4.0, 0.5)])
    assert (result.best, result.first_miss) == (4.0, 16.0)
