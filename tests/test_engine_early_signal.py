"""SIGTERM before the engine serves (while it imports torch or loads) is a clean, empty drain."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.engines import ROOT


@pytest.mark.parametrize("delay", [0.3, 1.0])
def test_sigterm_during_start_up_exits_zero(delay):
    proc = subprocess.Popen([sys.executable, "-m", "engine_service", "--port", "0", "--model", "small"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err
