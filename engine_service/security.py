"""Transport security and caller authentication: TLS / mutual TLS credentials, and a bearer
token required for EngineService (health and reflection stay open)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

from engine_service.config import ServerConfig
from shared.errors import Unauthenticated, to_status

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

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

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
        return _deny(handler, Unauthenticated(f"{why} bearer token for {details.method}",
                                              metadata={"scheme": "Bearer", "method": details.method}))


def _deny(handler: grpc.RpcMethodHandler, err: Unauthenticated) -> grpc.RpcMethodHandler:
    status = to_status(err)

    async def unary(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(status.code, status.details, status.trailing_metadata)

    async def streaming(request: object, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        await context.abort(status.code, status.details, status.trailing_metadata)
        yield  # never reached: makes this an async generator, as a streaming handler must be

    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, response_serializer=handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(unary, response_serializer=handler.response_serializer)
