"""The SLO search: the largest load (request rate or concurrency) at which a server meets its SLOs.

The search runs per server, engine configuration and point of the rest of the grid, over `[search]`'s
`over` in [low, high], a bounded bisection: it probes `high` first (met there: the answer is at
least high), then `low` (missed there: the answer is below low), then the middle of the largest
value that met the target attainment and the smallest that missed it (the geometric middle for a
request rate, the integer one for a concurrency), until `steps` probes ran or nothing lies between.
Each probe is an ordinary point of the sweep, recorded durably as it ends (its record carries
`search`). The next probe is a function of the probes before it alone (`next_probe`), so a
resumed sweep replays the recorded probes and runs only those missing: a search is resumable like
any sweep.

A probe meets the target when its `slo_attainment` (metrics.py: the measured requests meeting
every SLO, failed ones missing it) is >= `attainment`; a skipped probe misses it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from bench_client.config import CONCURRENCY, SearchConfig


@dataclass(frozen=True)
class Probe:
    value: float
    attainment: float  # 0 for a skipped point

    def meets(self, target: float) -> bool:
        return self.attainment >= target


@dataclass(frozen=True)
class SearchResult:
    best: float | None  # the largest probed value that met the target; None: not even `low`
    first_miss: float | None  # the smallest probed value above `best` that missed it; None: `high` met it
    probes: int


def next_probe(search: SearchConfig, probes: Sequence[Probe]) -> float | None:
    """The value to probe next after `probes` (in the order they ran), or None: the search is done."""
    if len(probes) >= search.steps:
        return None
    if not probes:
        return search.high
    if len(probes) == 1:
        return None if probes[0].meets(search.attainment) else search.low
    result = result_of(search, probes)
    if result.best is None or result.first_miss is None:
        return None
    middle = _middle(search, result.best, result.first_miss)
    return middle if result.best < middle < result.first_miss else None


def result_of(search: SearchConfig, probes: Sequence[Probe]) -> SearchResult:
    met = [p.value for p in probes if p.meets(search.attainment)]
    best = max(met) if met else None
    above = [p.value for p in probes if not p.meets(search.attainment) and (best is None or p.value > best)]
    return SearchResult(best=best, first_miss=min(above) if above else None, probes=len(probes))


def _middle(search: SearchConfig, low: float, high: float) -> float:
    if search.over == CONCURRENCY:
        return float((int(low) + int(high)) // 2)
    return float(f"{math.sqrt(low * high):.4g}")  # 4 significant digits: a readable rate, the same on resume
