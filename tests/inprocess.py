"""An engine and its gRPC server in the test's own process and event loop (port 0), with a
Prometheus endpoint and the `request_finished` events captured, for tests that reach inside."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import structlog
from structlog.testing import LogCapture

from engine.v1 import engine_pb2_grpc
from engine_service.config import EngineConfig, ServerConfig
from engine_service.runtime.build import build_engine
from engine_service.runtime.engine import Engine
from engine_service.transport import telemetry as telemetry_module
from engine_service.transport.engine_slot import EngineSlot
from engine_service.transport.metrics import EngineMetrics, MetricsServer, start_metrics_server
from engine_service.transport.server import RunningServer, create_server
from engine_service.transport.telemetry import RequestTelemetry


@dataclass
class Served:
    engine: Engine
    running: RunningServer
    stub: engine_pb2_grpc.EngineServiceStub
    metrics: MetricsServer
    captured: LogCapture = field(default_factory=LogCapture)

    def finished(self, request_id: str) -> list[dict]:
        """The `request_finished` events logged for `request_id`."""
        return [e for e in self.captured.entries
                if e["event"] == "request_finished" and e.get("request_id") == request_id]


@asynccontextmanager
async def served(config: EngineConfig, monkeypatch, server_config: ServerConfig | None = None  # type: ignore[no-untyped-def]
                 ) -> AsyncIterator[Served]:
    """Start an engine with `config` behind a server on port 0; stop both at the end. The
    telemetry module's logger is replaced by a capturing one for the test (`monkeypatch`), which
    does not depend on how structlog was configured earlier in this process."""
    captured = LogCapture()
    capturing = structlog.wrap_logger(None, processors=[captured], wrapper_class=structlog.BoundLogger)
    monkeypatch.setattr(telemetry_module, "log", capturing)
    meter, metrics = start_metrics_server("127.0.0.1", 0)
    engine = await build_engine(config)
    running = await create_server(EngineSlot.holding(engine), server_config or ServerConfig(port=0),
                                  RequestTelemetry(EngineMetrics(meter, engine.load, engine.waiting)))
    await running.server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            yield Served(engine, running, engine_pb2_grpc.EngineServiceStub(channel), metrics, captured)
    finally:
        engine.stop()
        await running.stop(0)
        metrics.stop()
