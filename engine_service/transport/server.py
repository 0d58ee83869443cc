"""The gRPC server: EngineService, health, reflection, and with --http-port the OpenAI-compatible
HTTP front beside it (http_front.py, the same engine on the same loop); start-up, drain and fatal
shutdown.

`create_server` builds and binds (tests use port 0); `serve` runs the whole lifecycle and
returns the process exit code: 0 after a drain, 2 when the model cannot load; after a fatal
error in the decode loop it exits the process itself with 70.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.v1 import engine_pb2
from engine_service.config import EngineConfig, ServerConfig
from engine_service.runtime.build import build_engine
from engine_service.runtime.engine import Engine
from engine_service.runtime.loop import FATAL_EXIT_CODE
from engine_service.transport import early_stop
from engine_service.transport.engine_slot import EngineSlot
from engine_service.transport.metrics import EngineMetrics, disabled_meter, start_metrics_server
from engine_service.transport.security import BearerTokenInterceptor, server_credentials
from engine_service.transport.servicer import SERVICE_NAME, EngineServicer
from engine_service.transport.telemetry import RequestTelemetry
from shared.errors import EngineDraining
from shared.heap import frozen_heap
from shared.tracing import flush_traces

if TYPE_CHECKING:  # imported where --http-port asks for it: aiohttp and the front cost 0.3 s of every start
    from engine_service.transport.http_front import HttpFront, RunningHttp

log = structlog.get_logger()

STARTUP_FAILED_EXIT_CODE = 2
HEALTH_SERVICES = ("", SERVICE_NAME)


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    slot: EngineSlot  # what it serves: LOADING, then READY with the engine
    http: HttpFront | None = None  # the OpenAI-compatible front, with --http-port
    http_running: RunningHttp | None = None

    @property
    def http_port(self) -> int | None:
        return self.http_running.port if self.http_running is not None else None

    async def stop(self, grace: float | None) -> None:
        """Stop both fronts: gRPC's within `grace` seconds, then HTTP's (its open streams closed
        after http_front.SHUTDOWN_TIMEOUT_S)."""
        await self.server.stop(grace)
        if self.http_running is not None:
            await self.http_running.runner.cleanup()


def grpc_options(cfg: ServerConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", cfg.max_receive_bytes),
        ("grpc.max_concurrent_streams", cfg.max_concurrent_streams),
        ("grpc.so_reuseport", 0),
    ]


def replica_name(host: str, port: int) -> str:
    """How this server names itself to clients: host:port, the host name for a wildcard host."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    return f"{host}:{port}"


async def create_server(slot: EngineSlot, cfg: ServerConfig, telemetry: RequestTelemetry | None = None
                        ) -> RunningServer:
    """Build the server serving what `slot` holds (or will) with every service registered, and
    bind it; health starts NOT_SERVING. Without `telemetry`, requests are logged and traced but no
    metrics are kept."""
    telemetry = telemetry or RequestTelemetry(EngineMetrics(disabled_meter(), slot.load, slot.waiting))
    interceptors = [BearerTokenInterceptor(cfg.auth_token, telemetry)] if cfg.auth_token else []
    server = grpc.aio.server(options=grpc_options(cfg), interceptors=interceptors)
    servicer = EngineServicer(slot, telemetry, log_text=cfg.log_text)
    server.add_generic_rpc_handlers((servicer.handler(),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name, health.SERVICE_NAME,
         reflection.SERVICE_NAME),
        server,
    )
    for name in HEALTH_SERVICES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"{cfg.host}:{cfg.port}"
    credentials = server_credentials(cfg)
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"could not bind the gRPC server to {address}")
    servicer.replica = replica_name(cfg.host, port)
    running = RunningServer(server, port, health_servicer, slot)
    if cfg.http_port is not None:
        from engine_service.transport.http_front import HttpFront

        running.http = HttpFront(slot, telemetry, cfg)
        try:
            running.http_running = await running.http.start(cfg.host, cfg.http_port)
        except OSError:
            await server.stop(0)
            raise
    return running


async def set_health(running: RunningServer, status: int) -> None:
    for name in HEALTH_SERVICES:
        await running.health.set(name, status)
    if running.http is not None:
        running.http.serving = status == health_pb2.HealthCheckResponse.SERVING


async def serve(engine_cfg: EngineConfig, server_cfg: ServerConfig) -> int:
    """Run until drained (returns 0) or until the model fails to load (2); a fatal error exits the
    process with 70 from here (see `exit_now`)."""
    slot = EngineSlot()
    meter, metrics_server = disabled_meter(), None
    if server_cfg.metrics_port is not None:
        try:
            meter, metrics_server = start_metrics_server(server_cfg.host, server_cfg.metrics_port)
        except OSError as err:
            log.error("engine_start_failed", error_type=type(err).__name__, error=str(err))
            return STARTUP_FAILED_EXIT_CODE
        log.info("metrics_started", host=server_cfg.host, port=metrics_server.port, path="/metrics")
    telemetry = RequestTelemetry(EngineMetrics(meter, slot.load, slot.waiting))
    try:
        return await _serve(engine_cfg, slot, server_cfg, telemetry)
    finally:
        if metrics_server is not None:
            metrics_server.stop()


async def _serve(engine_cfg: EngineConfig, slot: EngineSlot, server_cfg: ServerConfig,
                 telemetry: RequestTelemetry) -> int:
    try:
        running = await create_server(slot, server_cfg, telemetry)
    except OSError as err:  # the HTTP front's port taken (gRPC's own raises from add_insecure_port as before)
        log.error("engine_start_failed", error_type=type(err).__name__, error=str(err))
        return STARTUP_FAILED_EXIT_CODE
    await running.server.start()
    log.info("server_started", host=server_cfg.host, port=running.port, http_port=running.http_port,
             tls=server_cfg.tls_cert is not None, mtls=server_cfg.tls_client_ca is not None,
             auth=server_cfg.auth_token is not None)

    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    fatal = asyncio.Event()
    for sig in early_stop.SIGNALS:
        loop.add_signal_handler(sig, stop_requested.set)
    if early_stop.requested():  # one came before the loop's handlers, recorded during an import or swallowed
        log.info("stop_signal_before_serving")
        stop_requested.set()

    async def build_watched() -> Engine:
        engine = await build_engine(engine_cfg)
        # in the same task, before anything else runs on the event loop: no fatal goes unseen
        engine.on_fatal(lambda exc: fatal.set())
        return engine

    starting = asyncio.create_task(build_watched())
    stopping = asyncio.create_task(stop_requested.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done() and starting.exception() is not None:
        err = starting.exception()
        log.error("engine_start_failed", error_type=type(err).__name__, error=str(err))
        await running.stop(0)
        return STARTUP_FAILED_EXIT_CODE
    if not starting.done():
        starting.cancel()
        log.info("engine_stopped_while_loading")
        await running.stop(0)
        return 0
    engine = starting.result()
    slot.fill(engine)
    with frozen_heap() as frozen:  # the model and all start-up made, out of the collector's full passes
        await set_health(running, health_pb2.HealthCheckResponse.SERVING)
        log.info("engine_serving", port=running.port, http_port=running.http_port, gc_frozen_objects=frozen)

        fatal_wait = asyncio.create_task(fatal.wait())
        await asyncio.wait({stopping, fatal_wait}, return_when=asyncio.FIRST_COMPLETED)
        if fatal.is_set():
            await set_health(running, health_pb2.HealthCheckResponse.NOT_SERVING)
            await engine.wait_idle(0.5)  # the streams in flight are being told UNAVAILABLE
            await asyncio.sleep(0.1)  # and gRPC writes those statuses out before the sockets close
            # the loop thread's watchdog exits the process within FATAL_EXIT_AFTER_SECONDS: export now
            await asyncio.to_thread(flush_traces, 0.5)
            log.error("engine_exiting", exit_code=FATAL_EXIT_CODE)
            exit_now(FATAL_EXIT_CODE)
        fatal_wait.cancel()
        return await drain(running, server_cfg.grace_seconds)


async def drain(running: RunningServer, grace_seconds: float) -> int:
    """Admit nothing new (ENGINE_DRAINING), let streams in flight finish within the grace period,
    end the rest with ENGINE_DRAINING, then stop the server."""
    engine = running.slot.ready_engine()
    engine.begin_drain(grace_seconds)
    await running.health.enter_graceful_shutdown()
    if running.http is not None:
        running.http.serving = False  # /health 503 "draining"
    log.info("engine_draining", grace_seconds=grace_seconds, in_flight=engine.load().running_sequences)
    if not await engine.wait_idle(grace_seconds):
        cut = engine.end_all(EngineDraining.build(grace_seconds))
        log.warning("drain_grace_expired", streams_cut=cut)
        await engine.wait_idle(2.0)
    engine.stop()
    await running.stop(1.0)
    log.info("engine_stopped", exit_code=0)
    return 0


def exit_now(code: int) -> NoReturn:
    """Leave the process at once, with no server.stop(): on stop, gRPC core cancels the calls it
    has accepted but not yet handed to a handler, and their callers would read CANCELLED, a code
    that says "your side cancelled". Exiting closes the sockets instead, so every caller, in
    flight or arriving, reads UNAVAILABLE: the contract's "the engine died"."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
