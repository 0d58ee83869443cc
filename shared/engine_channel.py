"""The channel to the engine, for any Python service that calls it (the bench client uses it too).

    from shared.engine_channel import EngineTls, open_engine_channel
    engine = open_engine_channel("ipv4:10.0.0.1:50051,10.0.0.2:50051", token=token, tls=EngineTls(ca_pem=ca))
    stub = engine_pb2_grpc.EngineServiceStub(engine.channel)
    async for message in stub.Decode(request, timeout=60, metadata=engine.metadata): ...

What the channel does:
- `target` is any gRPC target: `host:port`, `ipv4:a:p,b:p,c:p` (a fixed list of replicas) or
  `dns:///name:port` (every A record of a headless Service or a compose service, re-resolved
  when a connection fails).
- round_robin over the resolved addresses, with gRPC client-side health checking (proposal A17,
  implemented in C-core): each connection watches `grpc.health.v1.Health/Watch` for the service
  `engine.v1.EngineService`, and a replica that answers NOT_SERVING (loading its model, draining
  after SIGTERM, dying) gets no new calls until it answers SERVING again. Calls already on it go
  on. With every replica unhealthy, calls fail at once with UNAVAILABLE (no wait_for_ready):
  the caller decides how long to wait (the bench client polls health, bounded).
- The channel does not retry (`grpc.enable_retries` 0): the caller's policy does, from the
  contract's codes (UNAVAILABLE / ENGINE_DRAINING before the first token: retry, on whichever
  replica is healthy; never mid-stream).
- Reconnection backoff is capped at `MAX_RECONNECT_BACKOFF_MS` (gRPC's default cap is 120 s), so a
  restarted replica rejoins within seconds of serving again.
- TLS when `tls` is given (a client certificate for mutual TLS, a server name override); else
  plaintext. The bearer token travels as call metadata (`engine.metadata`), to pass on every
  EngineService call: health and reflection are open and need none, and call credentials would
  refuse a plaintext channel.
- Which replica served a Decode call: `replica_of(await call.initial_metadata())` (the engine's
  `engine-replica` header; grpcio has no client-side peer address).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

SERVICE_NAME = "engine.v1.EngineService"
MAX_RECEIVE_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_RECONNECT_BACKOFF_MS = 5_000
# The engine names itself (host:port as it is bound, the host name for a wildcard host) in this
# initial-metadata key of every Decode answer: grpcio gives a client no peer address of a call,
# and behind round_robin that is the only way to tell which replica served it.
REPLICA_HEADER = "engine-replica"

ChannelOption = tuple[str, str | int]


@dataclass(frozen=True)
class EngineTls:
    """TLS to the engine, as PEM bytes. No `ca_pem`: the system's roots. `cert_pem` and `key_pem`
    together: a client certificate (mutual TLS). `server_name`: the name to check the server's
    certificate against when it differs from the target's host."""

    ca_pem: bytes | None = field(default=None, repr=False)
    cert_pem: bytes | None = field(default=None, repr=False)
    key_pem: bytes | None = field(default=None, repr=False)
    server_name: str | None = None


def service_config(*, health_check: bool = True) -> str:
    """The channel's service config (JSON): round_robin, with client-side health checking of
    `engine.v1.EngineService` unless `health_check` is False."""
    config: dict[str, object] = {"loadBalancingConfig": [{"round_robin": {}}]}
    if health_check:
        config["healthCheckConfig"] = {"serviceName": SERVICE_NAME}
    return json.dumps(config)


def channel_options(tls: EngineTls | None = None, *, health_check: bool = True) -> list[ChannelOption]:
    """The options every engine channel gets (for `grpc.insecure_channel` / `secure_channel` when
    building one by hand)."""
    options: list[ChannelOption] = [
        ("grpc.service_config", service_config(health_check=health_check)),
        ("grpc.enable_retries", 0),  # the caller's policy retries, from the contract's codes
        ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]
    if tls is not None and tls.server_name is not None:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries a bearer token (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def channel_credentials(tls: EngineTls) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=tls.ca_pem, private_key=tls.key_pem,
                                        certificate_chain=tls.cert_pem)


@dataclass(frozen=True)
class EngineChannel:
    """A grpc.aio channel to the engine and the metadata to send on each EngineService call."""

    target: str
    channel: grpc.aio.Channel
    metadata: tuple[tuple[str, str], ...]

    async def close(self) -> None:
        await self.channel.close()


def open_engine_channel(target: str, *, token: str | None = None, tls: EngineTls | None = None,
                        health_check: bool = True,
                        extra_options: Sequence[ChannelOption] = ()) -> EngineChannel:
    """A grpc.aio channel to `target` as the module docstring describes (call it inside a running
    event loop, as grpc.aio wants)."""
    options = [*channel_options(tls, health_check=health_check), *extra_options]
    if tls is None:
        channel = grpc.aio.insecure_channel(target, options=options)
    else:
        channel = grpc.aio.secure_channel(target, channel_credentials(tls), options=options)
    return EngineChannel(target, channel, auth_metadata(token))


def open_engine_channel_sync(target: str, *, tls: EngineTls | None = None, health_check: bool = True,
                             extra_options: Sequence[ChannelOption] = ()) -> grpc.Channel:
    """The same channel for synchronous code; pass `auth_metadata(token)` as each call's metadata."""
    options = [*channel_options(tls, health_check=health_check), *extra_options]
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, channel_credentials(tls), options=options)


def replica_of(initial_metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The replica that answered a call, from its initial metadata (`engine-replica`), or None."""
    for key, value in initial_metadata or ():
        if key == REPLICA_HEADER:
            return value.decode() if isinstance(value, bytes) else value
    return None
