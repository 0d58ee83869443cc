"""AIPerf against our client on the real llama-server: benchmarks/aiperf_crosscheck.py --short.

Left out of `make test` (marker `crosscheck`: a few minutes, and AIPerf installed into its own venv
the first time); `pytest -m crosscheck` runs it. Skipped without llama-server (`make peers`),
failed instead under CI=true, as tests/llama_server.py's require_llama_server does.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.engines import ROOT
from tests.llama_server import require_llama_server

SCRIPT = ROOT / "benchmarks" / "aiperf_crosscheck.py"
JUDGED = ("TTFT p50 ms", "TPOT p50 ms", "ITL mean ms", "output tok/s")


@pytest.mark.crosscheck
@pytest.mark.timeout(1500)  # first run: ~80 s to install AIPerf; then about 2-4 minutes
def test_aiperf_and_ours_agree_within_10_percent(tmp_path):
    require_llama_server()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--short", "--out", str(tmp_path / "work")], cwd=ROOT,
                          capture_output=True, text=True, timeout=1400, check=False)
    shown = f"--- stdout ---\n{proc.stdout}\n--- stderr tail ---\n{proc.stderr[-4000:]}"
    for concurrency in (1, 8):
        assert f"c={concurrency}: " in proc.stdout, shown
    for row in JUDGED:
        assert proc.stdout.count(f"  {row} ") == 2, shown  # one row per concurrency
    assert proc.returncode == 0, shown
    assert "all judged figures agree within 10%" in proc.stdout, shown
