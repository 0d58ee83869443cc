"""A stop signal (SIGTERM, SIGINT) that arrives before the event loop takes the signals over: while
torch imports, while the gRPC server starts. `python -m engine_service` installs `take` first
thing (engine_service/__main__.py); `serve` asks `requested` once its loop's own handlers are in
place and, if one came, drains at once (nothing is serving yet, so an empty drain, exit 0).

The handler records the signal, and raises SystemExit only when no import is under way. An
exception raised into an import is not safe: raised while numpy's C extension initialised under
`import torch`, the SystemExit came out as "ImportError: cannot load module more than once per
process", a traceback and exit 1 (a clean-clone CI run, SIGTERM 0.3 s after the start). And a
SystemExit raised somewhere in the imports was swallowed without a word in about one start in
three on a 2-core Zen 4, so the engine loaded and served, deaf to the signal. So during an import
the signal is only recorded: `__main__` exits 0 once the heavy imports are done, and `serve`
checks again before it loads the model. This module imports nothing heavy: it runs before torch.
"""

from __future__ import annotations

import signal
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received: list[int] = []
_IMPORT_MACHINERY = "<frozen importlib._bootstrap"  # both _bootstrap and _bootstrap_external


def take(signum: int, frame: FrameType | None) -> None:
    """The stop signals' handler until the event loop runs: record, then end the start-up unless
    an import is under way (`requested` is asked once it is done)."""
    _received.append(signum)
    if not importing(frame):
        raise SystemExit(0)


def importing(frame: FrameType | None) -> bool:
    """Whether the import machinery is on the stack that `frame` ends."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(_IMPORT_MACHINERY):
            return True
        frame = frame.f_back
    return False


def install() -> None:
    for sig in SIGNALS:
        signal.signal(sig, take)


def requested() -> bool:
    """Whether a stop signal came before the event loop's handlers (raised or only recorded)."""
    return bool(_received)
