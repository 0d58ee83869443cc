"""Transport security and caller authentication: TLS / mutual TLS credentials, and a bearer
token required for EngineService (health and reflection stay open).

A refused call is logged (`call_unauthenticated`, with the method and the peer, never the token);
a refused Decode is also a finished request like any other rejection: its server span (a child
of the caller's), its `request_finished` event and its count under status UNAUTHENTICATED."""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable

import grpc
import structlog

from engine_service.config import ServerConfig
from engine_service.transport.telemetry import RequestOutcome, RequestTelemetry
from shared.errors import Unauthenticated, to_status
from shared.tracing import extract_context

log = structlog.get_logger()

PROTECTED_PREFIX = "/engine.v1.EngineService/"


def server_credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials when --tls-cert/--tls-key are set; client certificates are required
    when --tls-client-ca is set too. None means plaintext."""
    if cfg.tls_cert is None or cfg.tls_key is None:
        return None
    pair = (cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes())
    client_ca = cfg.tls_client_ca.read_bytes() if cfg.tls_client_ca is not None else None
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca, require_client_auth=client_ca is not None)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on EngineService methods, compared in constant time."""

    def __init__(self, token: str, telemetry: RequestTelemetry) -> None:
        self._expected = f"Bearer {token}".encode()
        self._telemetry = telemetry

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(PROTECTED_PREFIX):
            return handler
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        sent_bytes = sent.encode() if isinstance(sent, str) else sent
        if hmac.compare_digest(sent_bytes, self._expected):
            return handler
        why = "missing" if not sent else "invalid"
        return self._deny(handler, details.method, why, Unauthenticated(
            f"{why} bearer token for {details.method}", metadata={"scheme": "Bearer", "method": details.method}))

    def _deny(self, handler: grpc.RpcMethodHandler, method: str, why: str,
              err: Unauthenticated) -> grpc.RpcMethodHandler:
        status = to_status(err)
        rpc_name = method.removeprefix(PROTECTED_PREFIX)

        async def refuse(context: grpc.aio.ServicerContext) -> None:
            log.warning("call_unauthenticated", method=method, credential=why, peer=context.peer())
            if rpc_name == "Decode":
                started = time.monotonic()
                span = self._telemetry.start_span(rpc_name, extract_context(context.invocation_metadata()))
                self._telemetry.finish(span, RequestOutcome(request_id="", code=status.code, error=err,
                                                            started=started, ended=time.monotonic()))
            await context.abort(status.code, status.details, status.trailing_metadata)

        async def unary(request: object, context: grpc.aio.ServicerContext) -> None:
            await refuse(context)

        async def streaming(request: object, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
            await refuse(context)
            yield  # never reached: makes this an async generator, as a streaming handler must be

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(streaming, response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(unary, response_serializer=handler.response_serializer)
