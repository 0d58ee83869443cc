"""SIGTERM before the engine serves (while it imports torch or loads) is a clean, empty drain."""

from __future__ import annotations

import importlib
import signal
import subprocess
import sys
import time

import pytest

from engine_service.transport import early_stop
from tests.engines import ROOT


# 0.35-0.47 s fell in the imports on a 2-core Zen 4, where the handler's SystemExit was swallowed
# in about one start in three before early_stop recorded the signal (the engine then served on)
@pytest.mark.parametrize("delay", [0.3, 0.4, 1.0])
def test_sigterm_during_start_up_exits_zero(delay):
    proc = subprocess.Popen([sys.executable, "-m", "engine_service", "--port", "0", "--model", "small"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err


def test_a_stop_signal_before_the_event_loop_is_recorded_as_well_as_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(early_stop, "_received", [])
    assert not early_stop.requested()
    with pytest.raises(SystemExit) as exit_info:
        early_stop.take(signal.SIGTERM, None)
    assert exit_info.value.code == 0
    assert early_stop.requested()  # what serve() asks once its loop's handlers are in place


def test_a_stop_signal_during_an_import_is_recorded_not_raised_into_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    # raised into an import, the SystemExit came out of numpy's C extension as an ImportError (exit 1)
    monkeypatch.setattr(early_stop, "_received", [])
    (tmp_path / "signalled_while_imported.py").write_text(
        "import signal, sys\n"
        "from engine_service.transport import early_stop\n"
        "early_stop.take(signal.SIGTERM, sys._getframe())\n"
        "FINISHED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("signalled_while_imported")
    assert module.FINISHED
    assert early_stop.requested()
    monkeypatch.delitem(sys.modules, "signalled_while_imported")
    with pytest.raises(SystemExit):  # the same frame's caller, the import done: ended at once
        early_stop.take(signal.SIGINT, sys._getframe())
