"""Start real engine processes on loopback: the one launcher of the tests, the drills and the
benchmarks (`python -m engine_service --port 0 ...` in this checkout, its JSON log lines collected).
The bench client's own managed engine (bench_client/engine_process.py) is a product feature with
log files and restarts, not this development tool, which lives in tools/ so that it does not ship in
the wheel (it runs the engine of a checkout). Both wait and stop through bench_client.server_process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench_client.server_process import wait_until_serving_blocking
from engine.v1 import engine_pb2 as pb
from engine.v1 import engine_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


class EngineProcess:
    """`python -m engine_service --port 0 ARGS...`, its JSON log lines collected as they come."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, start_timeout: float = 60.0) -> None:
        # one thread, and the traced step alone (AOTInductor's compile is a minute at the first start
        # of each model and context): later flags win, so a caller passes --compile-decode auto to measure
        self.args = ["--port", "0", "--threads", "1", "--compile-decode", "off", *args]
        self.start_timeout = start_timeout  # `with`'s wait for the port and SERVING (a first compile: 300)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.events: list[dict] = []
        self.raw_lines: list[str] = []
        self.port: int | None = None
        self.http_port: int | None = None  # the HTTP front's, with --http-port
        self._port_seen = threading.Event()
        self.proc: subprocess.Popen[str] | None = None

    def start(self, wait_serving: bool = True, timeout: float = 60.0) -> EngineProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine_service", *self.args], cwd=ROOT, env=self.env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        if not self._port_seen.wait(timeout):
            self.kill()
            raise RuntimeError(f"engine did not report its port within {timeout}s: {self.raw_lines[-20:]}")
        if wait_serving:
            self.wait_serving(timeout)
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.raw_lines.append(line)
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # not a log event (a Python warning, for instance): kept in raw_lines
            self.events.append(event)
            if event.get("event") == "server_started":
                self.port = int(event["port"])
                self.http_port = event.get("http_port")
                self._port_seen.set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def stub(self) -> engine_pb2_grpc.EngineServiceStub:
        return engine_pb2_grpc.EngineServiceStub(self.channel())

    def health(self, service: str = "") -> int:
        return health_status(self.address, service)

    def wait_serving(self, timeout: float = 60.0) -> None:
        if wait_serving(self.address, timeout, self.proc):
            return
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"engine exited with {self.proc.returncode}: {''.join(self.raw_lines[-20:])}")
        raise RuntimeError(f"engine not SERVING within {timeout}s")

    def load(self) -> pb.Load:
        return self.stub().GetLoad(pb.GetLoadRequest(), timeout=5)

    def wait_load(self, predicate, timeout: float = 10.0) -> pb.Load:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while True:
            load = self.load()
            if predicate(load) or time.monotonic() > deadline:
                return load
            time.sleep(0.02)

    def events_named(self, name: str) -> list[dict]:
        return [e for e in self.events if e.get("event") == name]

    def wait_events(self, name: str, request_id: str | None = None, count: int = 1,
                    timeout: float = 10.0) -> list[dict]:
        """The events `name` (of `request_id` when given), once at least `count` have been read:
        the log reaches us through a pipe and a reader thread, later than the RPC's answer."""
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.events_named(name) if request_id is None or e.get("request_id") == request_id]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.02)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> EngineProcess:
        return self.start(timeout=self.start_timeout)

    def __exit__(self, *exc: object) -> None:
        self.kill()


def health_status(address: str, service: str = "", timeout: float = 5.0) -> int:
    """The grpc.health.v1 status of `service` at `address` (raises grpc.RpcError while it does not answer)."""
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


def wait_serving(address: str, timeout: float, proc: subprocess.Popen[Any] | None = None, poll_s: float = 0.05) -> bool:
    """Poll grpc.health.v1 at `address` until SERVING; False if `timeout` passes first, or `proc`
    (when given) exits."""

    def serving(check_timeout: float) -> bool:
        try:
            return health_status(address, timeout=check_timeout) == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False  # down or still starting: poll again

    return wait_until_serving_blocking(proc, serving, timeout, poll_s)
