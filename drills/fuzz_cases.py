"""What the fuzz-http drill's two halves (drills/fuzz_http.py: HTTP streams; drills/fuzz_files.py:
dataset files) share: strategies of JSON values, the edge sizes past what json.loads reads, the
hypothesis runner of each strategy, and the CaseTally of cases by kind and failed checks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drills.common import note


def sometimes(one_in: int) -> st.SearchStrategy[bool]:
    """True about once in `one_in` draws (hypothesis favours the ends of a range: the middle decides)."""
    return st.integers(0, one_in - 1).map(lambda i: i == one_in // 2)


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=6),
                         st.sampled_from([10**309, -(10**400), 2**1100]))
json_values = st.recursive(json_scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=4), kids, max_size=3)), max_leaves=8)

DEEP = 5000  # nesting past Python's recursion limit: json.loads raises RecursionError, not ValueError
LONG_NUMBER = "9" * 5000  # past the 4300 digits Python reads: json.loads raises a plain ValueError


class CaseTally:
    """Cases by kind, and for each failed check how many cases failed it and the first of them."""

    def __init__(self, drill: str) -> None:
        self.drill = drill
        self.cases: Counter[str] = Counter()
        self.failing_cases = 0
        self.failed: dict[str, list[str]] = {}

    def record(self, kind: str, wrong: list[tuple[str, str]], replay: Callable[[], str]) -> None:
        self.cases[kind] += 1
        self.failing_cases += bool(wrong)
        for check, what in wrong:
            if check not in self.failed:
                self.failed[check] = []
                note(self.drill, f"first failure of {check!r} ({kind}): {what}; the whole case: {_cut(replay())}")
            self.failed[check].append(what)


def _cut(text: str) -> str:
    return text if len(text) <= 1200 else f"{text[:900]}...({len(text)} characters)...{text[-200:]}"


def fuzz(strategy: st.SearchStrategy[Any], target: Callable[[Any], None], examples: int) -> None:
    settings(max_examples=max(2, examples), database=None, deadline=None, derandomize=True,
             suppress_health_check=list(HealthCheck))(given(strategy)(target))()
