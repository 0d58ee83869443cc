"""A managed server: the client starts it as a subprocess (this engine, or an OpenAI-compatible
peer such as llama-server), waits for health, restarts it after a crash (bounded), drains it with
SIGTERM, and keeps its exit code and log tail for the results.

The port: an engine.v1 server is started with `{port}` = 0 and binds a free port itself; the
runner reads the port from its `server_started` log line (as tools/local_engine.py does), so no
other process can take the port between choosing and binding it. A restart binds the same port
again, so the sweep's client keeps its target. An OpenAI-compatible server is given a port the
runner found free (llama-server and its kind do not report a port they chose); so is this engine
over its HTTP front (`api = "openai"`, `--http-port {port}` beside `--port 0`: a gRPC port of its
own, any free one, that the sweep does not use; bench_client/fronts.toml).
Health is the adapter's: engine.v1's gRPC health service, or `GET /health` answering 200 (this
engine's HTTP front answers 503 while it loads, drains or has failed).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from bench_client.command import build_command
from bench_client.config import EngineLaunchConfig
from bench_client.peers import PeerMissing
from bench_client.server_api import ENGINE_V1, ServerClient
from bench_client.server_process import free_port, guarded, stop, wait_until_serving

log = structlog.get_logger()


class EngineStartError(Exception):
    """A managed engine did not become SERVING; the message carries its exit code and log tail."""


@dataclass(frozen=True)
class EngineExit:
    """How one engine process ended, as recorded in engines.jsonl."""

    settings: dict[str, Any]
    command: tuple[str, ...]
    pid: int
    port: int
    how: str  # "drained", "killed_after_drain_timeout", "crashed", "failed_to_start"
    exit_code: int | None
    started_at: float
    stopped_at: float
    log_file: str
    log_tail: tuple[str, ...]

    def as_record(self) -> dict[str, Any]:
        return {
            "engine": self.settings, "command": list(self.command), "pid": self.pid, "port": self.port,
            "how": self.how, "exit_code": self.exit_code, "started_at": self.started_at,
            "stopped_at": self.stopped_at, "log_file": self.log_file, "log_tail": list(self.log_tail),
        }


def engine_configurations(launch: EngineLaunchConfig) -> list[dict[str, Any]]:
    """Every combination of the [engine.grid] settings, in the order the grid lists them."""
    keys = [key for key, _ in launch.grid]
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*(v for _, v in launch.grid))]


SERVER_STARTED = "server_started"  # the engine's log event that names the port it bound


class ManagedEngine:
    """One server configuration's process (and its restarts); also the sweep's HealthGate for it.
    `make_client` builds the adapter's client for a target (for health checks: over TLS when
    configured); `api` says how the port is chosen and what the target looks like."""

    def __init__(self, launch: EngineLaunchConfig, settings: dict[str, Any], log_path: Path,
                 on_exit: Callable[[EngineExit], None], make_client: Callable[[str], ServerClient],
                 api: str = ENGINE_V1) -> None:
        self.launch = launch
        self.settings = settings
        self.log_path = log_path
        self.api = api
        self.port = 0 if api == ENGINE_V1 else free_port()  # 0: the engine binds one and logs it
        self.target = ""  # known once the port is
        self.command: tuple[str, ...] = ()
        self.restarts = 0
        self._make_client = make_client
        self._on_exit = on_exit  # called with each EngineExit
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0
        self._log_offset = 0  # where this process's output starts in the log file
        self._last_exit: EngineExit | None = None
        self._lock = asyncio.Lock()
        self._client: ServerClient | None = None

    async def start(self) -> None:
        """Spawn the server and wait for SERVING within startup_timeout_s, else EngineStartError."""
        try:
            self._spawn()
        except PeerMissing as err:
            raise EngineStartError(f"server {self.settings} cannot start: {err}") from err
        if not await self._wait_healthy(self.launch.startup_timeout_s):
            exit_ = await self._stop(how="failed_to_start")
            unbound = " (it never logged server_started with the port it bound)" if self.port == 0 else ""
            raise EngineStartError(
                f"server {self.settings} ({' '.join(self.command)}) was not SERVING within "
                f"startup_timeout_s={self.launch.startup_timeout_s:g} s{unbound}; exit code {exit_.exit_code}; "
                f"log {self.log_path}:\n" + "\n".join(exit_.log_tail[-15:]))

    async def wait_until_serving(self, timeout: float) -> bool:
        """The HealthGate: wait for SERVING; restart the engine whenever it has exited (at most
        engine.max_restarts times in all), each restart getting engine.startup_timeout_s."""
        async with self._lock:
            deadline = time.monotonic() + timeout
            while True:
                if self._proc is None or self._proc.poll() is not None:
                    if not self._restart():
                        return False
                    deadline = max(deadline, time.monotonic() + self.launch.startup_timeout_s)
                if await self._is_serving():
                    return True
                if time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(0.2)

    def _restart(self) -> bool:
        if self._proc is not None:
            self._record_exit("crashed")
        if self.restarts >= self.launch.max_restarts:
            log.error("engine_not_restarted", engine=self.settings, restarts=self.restarts,
                      max_restarts=self.launch.max_restarts)
            return False
        self.restarts += 1
        log.warning("engine_restarting", engine=self.settings, restart=self.restarts,
                    max_restarts=self.launch.max_restarts)
        self._spawn()
        return True

    async def stop(self) -> EngineExit:
        """Drain with SIGTERM; SIGKILL after engine.drain_timeout_s."""
        return await self._stop(how="drained")

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    def _spawn(self) -> None:
        self.command = tuple(build_command(self.launch.command, self.settings, self.port))
        log.info("engine_starting", engine=self.settings, command=" ".join(self.command), port=self.port or None)
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log_file:
            # Guarded, so that the engine gets SIGTERM if the sweep dies (even by kill -9).
            self._proc = subprocess.Popen(guarded(self.command), stdin=subprocess.DEVNULL, stdout=log_file,
                                          stderr=subprocess.STDOUT, env=engine_environment(os.environ))
        self._started_at = time.time()

    async def _is_serving(self, timeout: float = 1.0) -> bool:
        """One health check; False while the port is not known yet (the engine has not logged it)."""
        if self._client is None:
            if self.port == 0:
                port = bound_port(self.log_path, self._log_offset)
                if port is None:
                    return False
                self.port = port  # and every restart binds it again
            self.target = f"127.0.0.1:{self.port}" if self.api == ENGINE_V1 else f"http://127.0.0.1:{self.port}"
            self._client = self._make_client(self.target)
        return await self._client.is_serving(timeout=timeout)

    async def _wait_healthy(self, timeout: float) -> bool:
        if self._proc is None or not await wait_until_serving(self._proc, self._is_serving, timeout):
            return False
        log.info("engine_serving", engine=self.settings, target=self.target, pid=self._proc.pid)
        return True

    async def _stop(self, how: str) -> EngineExit:
        proc = self._proc
        if proc is None:
            raise RuntimeError(f"engine {self.settings} was never started")
        if proc.poll() is None:
            if await stop(proc, self.launch.drain_timeout_s):
                log.warning("engine_killed", engine=self.settings, pid=proc.pid,
                            drain_timeout_s=self.launch.drain_timeout_s)
                how = "killed_after_drain_timeout"
        elif how == "drained":
            how = "crashed"
        return self._record_exit(how)

    def _record_exit(self, how: str) -> EngineExit:
        proc = self._proc
        if proc is None or proc.returncode is None:
            raise RuntimeError(f"engine {self.settings} has not exited")
        if self._last_exit is not None and self._last_exit.pid == proc.pid:
            return self._last_exit  # this process's exit is already recorded
        exit_ = EngineExit(
            settings=self.settings, command=self.command, pid=proc.pid, port=self.port, how=how,
            exit_code=proc.returncode, started_at=self._started_at, stopped_at=time.time(),
            log_file=self.log_path.name, log_tail=tuple(tail(self.log_path, self.launch.log_tail_lines)),
        )
        level = log.info if how == "drained" and proc.returncode == 0 else log.warning
        level("engine_exited", engine=self.settings, how=how, exit_code=proc.returncode, pid=proc.pid)
        self._on_exit(exit_)
        self._last_exit = exit_
        return exit_


def bound_port(log_path: Path, offset: int) -> int | None:
    """The port of the first `server_started` event logged after `offset`, None before it appears."""
    try:
        with log_path.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return None
    for line in data.splitlines():
        if SERVER_STARTED.encode() not in line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line of other output that names the event: not the engine's JSON log line
        if isinstance(event, dict) and event.get("event") == SERVER_STARTED and isinstance(event.get("port"), int):
            return int(event["port"])
    return None


def tail(path: Path, lines: int, max_bytes: int = 64 * 1024) -> list[str]:
    """The last `lines` lines of a text file (reading at most its last `max_bytes`)."""
    if lines <= 0 or not path.exists():
        return []
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - max_bytes))
        data = f.read()
    return data.decode("utf-8", errors="replace").splitlines()[-lines:]


def engine_environment(parent: Mapping[str, str]) -> dict[str, str]:
    """The managed engine's environment: the client's, less OTEL_SERVICE_NAME, so that the engine
    reports its traces under its own default name ("engine") rather than the client's."""
    return {key: value for key, value in parent.items() if key != "OTEL_SERVICE_NAME"}
