"""A process supervisor for drills: restart the same command whenever it exits, as docker's
`restart: always` policy would, until stopped; stopping sends SIGTERM (a drain) to the live one."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

from bench_client.server_process import stop_blocking

RESTART_DELAY_S = 0.2


class Supervisor:
    def __init__(self, command: list[str], cwd: Path, log_path: Path) -> None:
        self.command, self.cwd, self.log_path = command, cwd, log_path
        self.exit_codes: list[int] = []  # of every run that ended, in order
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def _run(self) -> None:
        with self.log_path.open("ab") as log:
            while True:
                with self._lock:
                    if self._stopping.is_set():
                        return
                    self._proc = subprocess.Popen(self.command, cwd=self.cwd, stdout=subprocess.DEVNULL, stderr=log)
                code = self._proc.wait()
                self.exit_codes.append(code)
                if self._stopping.is_set():
                    return
                time.sleep(RESTART_DELAY_S)

    def stop(self, timeout: float = 30.0) -> int | None:
        """Drain the live process (SIGTERM), kill it if it outlasts `timeout`; returns its exit code."""
        with self._lock:
            self._stopping.set()
            proc = self._proc
        if proc is None:
            return None
        stop_blocking(proc, timeout)
        self._thread.join(timeout)
        return proc.returncode
