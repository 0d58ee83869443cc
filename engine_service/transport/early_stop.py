"""A stop signal (SIGTERM, SIGINT) that arrives before the event loop takes the signals over: while
torch imports, while the gRPC server starts. `python -m engine_service` installs `take` first
thing (engine_service/__main__.py); `serve` asks `requested` once its loop's own handlers are in
place and, if one came, drains at once (nothing is serving yet, so an empty drain, exit 0).

The handler records the signal before it raises SystemExit, because the SystemExit alone was lost
in about one start in three on a 2-core Zen 4 (SIGTERM 0.35-0.47 s after the start, before the
event loop took the signals): raised inside whatever code the main thread was running, it was
swallowed without a word (where exactly was not traced), and the engine went on to load and serve,
deaf to the SIGTERM it had been sent (tests/test_engine_early_signal.py). This module imports
nothing heavy: it runs before torch.
"""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received: list[int] = []


def take(signum: int, frame: object) -> None:
    """The stop signals' handler until the event loop runs: record, then end the start-up."""
    _received.append(signum)
    raise SystemExit(0)


def install() -> None:
    for sig in SIGNALS:
        signal.signal(sig, take)


def requested() -> bool:
    """Whether a stop signal came before the event loop's handlers (its SystemExit notwithstanding)."""
    return bool(_received)
