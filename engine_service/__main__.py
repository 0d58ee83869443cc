"""`python -m engine_service` / `engine-serve`.

The stop signals are taken first, before anything heavy is imported: a SIGTERM or SIGINT that
arrives while torch imports or the model loads is an empty drain and a clean exit 0, never a
death by signal. `serve()` hands them to its event loop once that runs.
"""

from __future__ import annotations

import signal


def _stop_before_serving(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_before_serving)
    from engine_service.cli import main as cli_main  # the heavy imports, once the signals are ours

    cli_main()


if __name__ == "__main__":
    main()
