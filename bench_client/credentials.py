"""The credentials of a sweep: TLS to the server and a bearer token, read once at load.

```toml
[tls]                               # optional: TLS to the server (the table alone: the system's CAs)
ca_file = "certs/ca.pem"            # PEM roots that sign the server's certificate
cert_file = "certs/client.pem"      # with key_file: a client certificate for mutual TLS
key_file = "certs/client.key"
server_name = "engine.internal"     # the name checked against the server's certificate

[auth]                              # optional: `authorization: Bearer <token>` on every call to the
token_file = "secrets/engine-token" # server (gRPC metadata, or the HTTP Authorization header); a file
token_env = "ENGINE_AUTH_TOKEN"     # holding the token, or the variable holding it (one of the two)
```

Relative paths are relative to the configuration file. A missing file, an empty token or an unset
variable is a ConfigError like any other; an error names where the token was looked for, never it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_client.config_fields import ConfigError, check_keys, read_str


@dataclass(frozen=True)
class TlsConfig:
    """TLS to the server; the PEM contents were read at load. No ca: the system's roots."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None
    ca_pem: bytes | None = field(default=None, repr=False)
    cert_pem: bytes | None = field(default=None, repr=False)
    key_pem: bytes | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ChannelSecurity:
    """How the client reaches the server: plaintext or TLS, with or without a bearer token."""

    tls: TlsConfig | None = None
    token: str | None = field(default=None, repr=False)
    token_source: str = ""  # "auth.token_file '/path'" or "auth.token_env 'NAME'": never the token


def read_security(raw: Mapping[str, Any], base_dir: Path, env: Mapping[str, str]) -> ChannelSecurity:
    """The [tls] and [auth] tables of a sweep configuration."""
    tls = read_tls(_table_of(raw, "tls"), base_dir) if "tls" in raw else None
    return ChannelSecurity(tls=tls, **read_auth(_table_of(raw, "auth"), base_dir, env))


def _table_of(raw: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"[{name}] must be a table, got {value!r}")
    return value


def read_tls(raw: Mapping[str, Any], base_dir: Path) -> TlsConfig:
    check_keys("tls.", raw, {"ca_file", "cert_file", "key_file", "server_name"})
    if ("cert_file" in raw) != ("key_file" in raw):
        given, missing = ("cert_file", "key_file") if "cert_file" in raw else ("key_file", "cert_file")
        raise ConfigError(f"tls.{given} {raw[given]!r} needs tls.{missing} (a client certificate and its key "
                          "go together), got nothing")
    files = {key: _pem_file(f"tls.{key}", raw[key], base_dir) for key in ("ca_file", "cert_file", "key_file")
             if key in raw}
    server_name = read_str("tls.server_name", raw["server_name"]) if "server_name" in raw else None
    return TlsConfig(
        ca_file=files["ca_file"][0] if "ca_file" in files else None,
        cert_file=files["cert_file"][0] if "cert_file" in files else None,
        key_file=files["key_file"][0] if "key_file" in files else None,
        server_name=server_name,
        ca_pem=files["ca_file"][1] if "ca_file" in files else None,
        cert_pem=files["cert_file"][1] if "cert_file" in files else None,
        key_pem=files["key_file"][1] if "key_file" in files else None,
    )


def read_auth(raw: Mapping[str, Any], base_dir: Path, env: Mapping[str, str]) -> dict[str, str | None]:
    """The bearer token from auth.token_file or auth.token_env; the error names where it was looked
    for, never the token itself."""
    check_keys("auth.", raw, {"token_file", "token_env"})
    if not raw:
        return {"token": None, "token_source": ""}
    if len(raw) > 1:
        raise ConfigError(f"auth.token_file {raw['token_file']!r} and auth.token_env {raw['token_env']!r} are "
                          "exclusive: give one")
    if "token_file" in raw:
        path = _existing_file("auth.token_file", raw["token_file"], base_dir)
        token, source = path.read_text(encoding="utf-8").strip(), f"auth.token_file {str(path)!r}"
    else:
        name = read_str("auth.token_env", raw["token_env"])
        token, source = env.get(name, "").strip(), f"auth.token_env {name!r}"
    if not token:
        raise ConfigError(f"{source} holds no token (empty or unset)")
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ConfigError(f"{source} holds a token with whitespace or non-ASCII characters; a bearer token "
                          "is one printable ASCII word")
    return {"token": token, "token_source": source}


def _existing_file(name: str, value: Any, base_dir: Path) -> Path:
    path = base_dir / Path(read_str(name, value)).expanduser()
    if not path.is_file():
        raise ConfigError(f"{name} {value!r} is not a readable file (looked for {str(path)!r})")
    return path


def _pem_file(name: str, value: Any, base_dir: Path) -> tuple[Path, bytes]:
    path = _existing_file(name, value, base_dir)
    data = path.read_bytes()
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{name} {value!r} is not a PEM file (no -----BEGIN line in {str(path)!r})")
    return path, data
