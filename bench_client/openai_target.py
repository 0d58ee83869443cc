"""Where an OpenAI-compatible server is and how each request reaches it: the base URL of a target
("http://host:port" or "https://...", a bare "host:port" meaning http, or https when the security
settings have TLS; a trailing "/v1" is dropped), the TLS context of an https:// target (the CA of the
settings, else the system's roots, and their client certificate), and the headers every request
carries (the bearer token, health included)."""

from __future__ import annotations

import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from bench_client.credentials import ChannelSecurity, TlsConfig


@dataclass(frozen=True)
class HttpTarget:
    base_url: str
    ssl: ssl.SSLContext | bool  # True: verified against the system's roots
    server_hostname: str | None  # the name the certificate must carry, where it is not the URL's host
    headers: Mapping[str, str]

    @classmethod
    def of(cls, target: str, security: ChannelSecurity) -> HttpTarget:
        url = base_url(target, tls=security.tls is not None)
        context: ssl.SSLContext | bool = True
        server_hostname = None
        if url.startswith("https://") and security.tls is not None:
            context = ssl_context(security.tls)
            server_hostname = security.tls.server_name
        headers = {"Accept": "text/event-stream, application/json"}
        if security.token:
            headers["Authorization"] = f"Bearer {security.token}"
        return cls(url, context, server_hostname, headers)

    def request_options(self, timeout: float) -> dict[str, Any]:
        """The keyword arguments of one aiohttp request to this target within `timeout` seconds."""
        options: dict[str, Any] = {"timeout": aiohttp.ClientTimeout(total=timeout), "ssl": self.ssl}
        if self.server_hostname:
            options["server_hostname"] = self.server_hostname
        return options


def base_url(target: str, *, tls: bool) -> str:
    """The base URL of `target`; raises ValueError for a scheme that contradicts the TLS settings."""
    target = target.strip().rstrip("/")
    if "://" not in target:
        target = ("https://" if tls else "http://") + target
    split = urlsplit(target)
    if split.scheme not in ("http", "https") or not split.hostname:
        raise ValueError(f"target must be an http:// or https:// URL (or host:port), got {target!r}")
    if tls and split.scheme == "http":
        raise ValueError(f"target {target!r} is plain http:// but the TLS settings (tls) ask for TLS: "
                         "use an https:// target or drop the tls settings")
    return target.removesuffix("/v1")


def ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """A client SSLContext: the CA of `tls` (else the system's roots) and its client certificate."""
    context = ssl.create_default_context(cadata=tls.ca_pem.decode() if tls.ca_pem else None)
    if tls.cert_pem or tls.key_pem:
        if not (tls.cert_pem and tls.key_pem):
            raise ValueError("tls: a client certificate needs both cert_file and key_file")
        with tempfile.TemporaryDirectory() as folder:  # load_cert_chain reads files only
            cert, key = Path(folder, "cert.pem"), Path(folder, "key.pem")
            cert.write_bytes(tls.cert_pem)
            key.touch(mode=0o600)
            key.write_bytes(tls.key_pem)
            context.load_cert_chain(cert, key)
    return context
