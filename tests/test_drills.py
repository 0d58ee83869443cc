"""Each reliability drill in its shortened (--quick) form: the same assertions as the full run.
The http drill runs against the real llama-server (`make peers`): where it is not built the test is
skipped, or failed under CI=true (tests/llama_server.py's require_llama_server)."""

from __future__ import annotations

import pytest

from drills import http_peer
from drills.__main__ import DRILLS, run_one
from tests.llama_server import require_llama_server


@pytest.mark.parametrize("name", list(DRILLS))
def test_drill_passes_quick(name: str) -> None:
    if name == http_peer.NAME:
        require_llama_server()
    row = run_one(name, quick=True)
    assert row.lost == 0, row
    assert row.passed, row.happened
