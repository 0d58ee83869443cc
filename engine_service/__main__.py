"""`python -m engine_service` / `engine-serve`.

The stop signals are taken first, before anything heavy is imported: a SIGTERM or SIGINT that
arrives while torch imports or the model loads is an empty drain and a clean exit 0, never a
death by signal (engine_service/transport/early_stop.py; one that comes during an import is
recorded, and the start-up ends once the imports are done). `serve()` hands them to its event loop
once that runs, and drains at once if one came before.
"""

from __future__ import annotations

from engine_service.transport import early_stop


def main() -> None:
    early_stop.install()
    from engine_service.cli import main as cli_main  # the heavy imports, once the signals are ours

    if early_stop.requested():  # one came during the imports: recorded, not raised into them
        raise SystemExit(0)
    cli_main()


if __name__ == "__main__":
    main()
