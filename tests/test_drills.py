"""Each reliability drill in its shortened (--quick) form: the same assertions as the full run."""

from __future__ import annotations

import pytest

from drills.__main__ import DRILLS, run_one


@pytest.mark.parametrize("name", list(DRILLS))
def test_drill_passes_quick(name: str) -> None:
    row = run_one(name, quick=True)
    assert row.lost == 0, row
    assert row.passed, row.happened
