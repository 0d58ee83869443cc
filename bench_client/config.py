"""The sweep configuration: one frozen dataclass per concern, read from TOML and validated once.

```toml
target = "127.0.0.1:50051"          # or "ipv4:127.0.0.1:50051,127.0.0.1:50052", "dns:///engine:50051"

[workload]                          # every combination of the lists is one point
context_tokens = [64, 256]          # exact prompt lengths in tokens
prefix_tokens = 0                   # the first N tokens of every prompt are shared (a system prompt,
prefix_groups = 1                   # for prefix caching): 0..min(context_tokens); with G groups, G distinct
                                    # prefixes, request i uses prefix i % G (G > 1 needs prefix_tokens >= 1)
max_new_tokens = [32]
concurrency = [1, 8]
request_rate = ["inf"]              # requests/s with Poisson arrivals, or "inf" (all at once)
requests_per_point = 32
warmup_requests = 2
seed = 0
ignore_eos = true
temperature = 0.0                   # sampling settings, sent with every request
top_p = 1.0
top_k = 0

[policy]                            # how the one policy table is tuned (see policy.py)
max_attempts = 5                    # per request, for retryable statuses
backoff_initial_s = 0.05
backoff_max_s = 2.0
health_wait_s = 30.0                # how long the engine may stay down before the sweep stops
request_timeout_s = 120.0
max_error_rate = 0.1                # a point with more failed requests than this is `failed`

[engine]                            # optional: the client starts and stops the engine itself
command = ["{python}", "-m", "engine_service", "--model", "tiny", "--host", "127.0.0.1", "--port", "{port}"]
startup_timeout_s = 120.0
drain_timeout_s = 30.0
max_restarts = 1                    # restarts after a crash, per engine configuration
[engine.grid]                       # each combination is one engine configuration
max_batch = [8, 32]                 # `{max_batch}` in the command, or appended as `--max-batch 8`

[preview]                           # optional: before the first point, ask the engine one chat question
question = "What is the capital of France?"   # and print the streamed answer (greedy); needs a model
system = "Answer in one sentence."  # with a chat template; optional system message
max_new_tokens = 64

[tls]                               # optional: TLS to the engine (the table alone: the system's CAs)
ca_file = "certs/ca.pem"            # PEM roots that sign the engine's certificate
cert_file = "certs/client.pem"      # with key_file: a client certificate for mutual TLS
key_file = "certs/client.key"
server_name = "engine.internal"     # the name checked against the engine's certificate

[auth]                              # optional: `authorization: Bearer <token>` on EngineService calls
token_file = "secrets/engine-token" # a file holding the token, or
token_env = "ENGINE_AUTH_TOKEN"     # the environment variable holding it (exactly one of the two)
```

Relative paths are relative to the configuration file. Files and the token are read once, at load:
a missing file, an empty token or an unset variable is a ConfigError like any other.
"""

from __future__ import annotations

import math
import os
import string
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Placeholders that the runner fills in itself; grid keys may not reuse them.
BUILTIN_PLACEHOLDERS = frozenset({"python", "port"})


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the key and the value."""


@dataclass(frozen=True)
class WorkloadConfig:
    context_tokens: tuple[int, ...]
    max_new_tokens: tuple[int, ...]
    concurrency: tuple[int, ...]
    request_rate: tuple[float, ...] = (math.inf,)
    requests_per_point: int = 16
    warmup_requests: int = 1
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    prefix_tokens: int = 0  # the first prefix_tokens of every prompt are one of prefix_groups shared prefixes
    prefix_groups: int = 1


@dataclass(frozen=True)
class PolicyConfig:
    max_attempts: int = 5
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    health_wait_s: float = 30.0
    request_timeout_s: float = 120.0
    max_error_rate: float = 0.1


@dataclass(frozen=True)
class EngineLaunchConfig:
    command: tuple[str, ...]
    grid: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    startup_timeout_s: float = 120.0
    drain_timeout_s: float = 30.0
    max_restarts: int = 1
    log_tail_lines: int = 40


@dataclass(frozen=True)
class PreviewConfig:
    """One chat question asked before the sweep's first point, its answer printed (bench_client.chat)."""

    question: str
    system: str = ""
    max_new_tokens: int = 64


@dataclass(frozen=True)
class TlsConfig:
    """TLS to the engine; the PEM contents were read at load. No ca: the system's roots."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None
    ca_pem: bytes | None = field(default=None, repr=False)
    cert_pem: bytes | None = field(default=None, repr=False)
    key_pem: bytes | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ChannelSecurity:
    """How the client reaches the engine: plaintext or TLS, with or without a bearer token."""

    tls: TlsConfig | None = None
    token: str | None = field(default=None, repr=False)
    token_source: str = ""  # "auth.token_file '/path'" or "auth.token_env 'NAME'": never the token


@dataclass(frozen=True)
class SweepConfig:
    target: str
    workload: WorkloadConfig
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    engine: EngineLaunchConfig | None = None
    security: ChannelSecurity = field(default_factory=ChannelSecurity)
    preview: PreviewConfig | None = None


# ---- reading -------------------------------------------------------------------------------------


def load_config(path: Path, env: Mapping[str, str] | None = None) -> SweepConfig:
    """Read and validate a sweep configuration file; ConfigError names what is wrong."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise ConfigError(f"config file {str(path)!r} does not exist") from err
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {err}") from err
    return parse_config(raw, base_dir=path.parent, env=env)


def parse_config(raw: Mapping[str, Any], *, base_dir: Path | None = None,
                 env: Mapping[str, str] | None = None) -> SweepConfig:
    """Validate a parsed configuration; relative paths are taken from `base_dir` (default: the
    working directory), `auth.token_env` is looked up in `env` (default: os.environ)."""
    _check_keys("", raw, {"target", "workload", "policy", "engine", "tls", "auth", "preview"})
    engine = _engine(raw["engine"]) if "engine" in raw else None
    if "target" in raw:
        target = _str("target", raw["target"])
        if engine is not None:
            raise ConfigError(f"target {target!r} and [engine] are exclusive: with [engine] the client "
                              "starts the engine itself and targets it")
    elif engine is not None:
        target = ""  # filled in per managed engine
    else:
        raise ConfigError("target is required when there is no [engine] table, got nothing")
    if "workload" not in raw:
        raise ConfigError("[workload] is required, got nothing")
    return SweepConfig(
        target=target,
        workload=_workload(_table("workload", raw["workload"])),
        policy=_policy(_table("policy", raw.get("policy", {}))),
        engine=engine,
        security=ChannelSecurity(
            tls=_tls(_table("tls", raw["tls"]), base_dir or Path.cwd()) if "tls" in raw else None,
            **_auth(_table("auth", raw.get("auth", {})), base_dir or Path.cwd(),
                    os.environ if env is None else env),
        ),
        preview=_preview(_table("preview", raw["preview"])) if "preview" in raw else None,
    )


def _workload(raw: Mapping[str, Any]) -> WorkloadConfig:
    _check_keys("workload.", raw, set(WorkloadConfig.__dataclass_fields__))
    for key in ("context_tokens", "max_new_tokens", "concurrency"):
        if key not in raw:
            raise ConfigError(f"workload.{key} is required, got nothing")
    defaults = WorkloadConfig((1,), (1,), (1,))
    config = WorkloadConfig(
        context_tokens=_int_list("workload.context_tokens", raw["context_tokens"], minimum=1),
        max_new_tokens=_int_list("workload.max_new_tokens", raw["max_new_tokens"], minimum=1),
        concurrency=_int_list("workload.concurrency", raw["concurrency"], minimum=1),
        request_rate=_rate_list("workload.request_rate", raw.get("request_rate", ["inf"])),
        requests_per_point=_int("workload.requests_per_point",
                                raw.get("requests_per_point", defaults.requests_per_point), minimum=1),
        warmup_requests=_int("workload.warmup_requests", raw.get("warmup_requests", defaults.warmup_requests),
                             minimum=0),
        seed=_int("workload.seed", raw.get("seed", defaults.seed), minimum=0),
        ignore_eos=_bool("workload.ignore_eos", raw.get("ignore_eos", defaults.ignore_eos)),
        temperature=_float("workload.temperature", raw.get("temperature", defaults.temperature), minimum=0.0),
        top_p=_float("workload.top_p", raw.get("top_p", defaults.top_p), minimum=0.0),
        top_k=_int("workload.top_k", raw.get("top_k", defaults.top_k), minimum=0),
        prefix_tokens=_int("workload.prefix_tokens", raw.get("prefix_tokens", defaults.prefix_tokens), minimum=0),
        prefix_groups=_int("workload.prefix_groups", raw.get("prefix_groups", defaults.prefix_groups), minimum=1),
    )
    if config.prefix_tokens > min(config.context_tokens):
        raise ConfigError(f"workload.prefix_tokens must be <= every workload.context_tokens value (the prefix is "
                          f"part of the prompt; smallest {min(config.context_tokens)}), got {config.prefix_tokens!r}")
    if config.prefix_groups > 1 and config.prefix_tokens == 0:
        raise ConfigError(f"workload.prefix_groups {config.prefix_groups!r} needs workload.prefix_tokens >= 1 "
                          "(groups of an empty prefix share nothing), got prefix_tokens 0")
    if not 0.0 < config.top_p <= 1.0:
        raise ConfigError(f"workload.top_p must be in (0, 1], got {config.top_p!r}")
    if config.temperature > 100.0:
        raise ConfigError(f"workload.temperature must be in [0, 100], got {config.temperature!r}")
    return config


def _policy(raw: Mapping[str, Any]) -> PolicyConfig:
    _check_keys("policy.", raw, set(PolicyConfig.__dataclass_fields__))
    d = PolicyConfig()
    config = PolicyConfig(
        max_attempts=_int("policy.max_attempts", raw.get("max_attempts", d.max_attempts), minimum=1),
        backoff_initial_s=_float("policy.backoff_initial_s", raw.get("backoff_initial_s", d.backoff_initial_s),
                                 minimum=0.0),
        backoff_max_s=_float("policy.backoff_max_s", raw.get("backoff_max_s", d.backoff_max_s), minimum=0.0),
        health_wait_s=_float("policy.health_wait_s", raw.get("health_wait_s", d.health_wait_s), minimum=0.0),
        request_timeout_s=_float("policy.request_timeout_s", raw.get("request_timeout_s", d.request_timeout_s),
                                 minimum=0.001),
        max_error_rate=_float("policy.max_error_rate", raw.get("max_error_rate", d.max_error_rate), minimum=0.0),
    )
    if config.max_error_rate > 1.0:
        raise ConfigError(f"policy.max_error_rate must be in [0, 1], got {config.max_error_rate!r}")
    if config.backoff_max_s < config.backoff_initial_s:
        raise ConfigError(f"policy.backoff_max_s must be >= policy.backoff_initial_s "
                          f"{config.backoff_initial_s!r}, got {config.backoff_max_s!r}")
    return config


def _engine(raw_value: Any) -> EngineLaunchConfig:
    raw = _table("engine", raw_value)
    allowed = set(EngineLaunchConfig.__dataclass_fields__)
    _check_keys("engine.", raw, allowed)
    if "command" not in raw:
        raise ConfigError("engine.command is required in [engine], got nothing")
    command = raw["command"]
    if not isinstance(command, list) or not command or not all(isinstance(p, str) for p in command):
        raise ConfigError(f"engine.command must be a non-empty list of strings, got {command!r}")
    grid_raw = _table("engine.grid", raw.get("grid", {}))
    grid: list[tuple[str, tuple[Any, ...]]] = []
    for key, values in grid_raw.items():
        name = f"engine.grid.{key}"
        if key in BUILTIN_PLACEHOLDERS:
            raise ConfigError(f"{name} is reserved (the runner fills {{{key}}} itself), got {values!r}")
        if not key.isidentifier():
            raise ConfigError(f"{name} must be an identifier such as max_batch, got {key!r}")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{name} must be a non-empty list, got {values!r}")
        for value in values:
            if isinstance(value, (dict, list)):
                raise ConfigError(f"{name} values must be strings, numbers or booleans, got {value!r}")
        grid.append((key, tuple(values)))
    known = BUILTIN_PLACEHOLDERS | {key for key, _ in grid}
    for part in command:
        for _, placeholder, _, _ in string.Formatter().parse(part):
            if placeholder is not None and placeholder not in known:
                raise ConfigError(f"engine.command placeholder {{{placeholder}}} is neither a builtin "
                                  f"({', '.join(sorted(BUILTIN_PLACEHOLDERS))}) nor a key of [engine.grid], "
                                  f"got it in {part!r}")
    if not any("{port}" in part for part in command):
        raise ConfigError(f"engine.command must contain the placeholder {{port}} (the runner picks a free "
                          f"port for each engine), got {command!r}")
    d = EngineLaunchConfig(command=())
    return EngineLaunchConfig(
        command=tuple(command),
        grid=tuple(grid),
        startup_timeout_s=_float("engine.startup_timeout_s", raw.get("startup_timeout_s", d.startup_timeout_s),
                                 minimum=0.1),
        drain_timeout_s=_float("engine.drain_timeout_s", raw.get("drain_timeout_s", d.drain_timeout_s),
                               minimum=0.1),
        max_restarts=_int("engine.max_restarts", raw.get("max_restarts", d.max_restarts), minimum=0),
        log_tail_lines=_int("engine.log_tail_lines", raw.get("log_tail_lines", d.log_tail_lines), minimum=0),
    )


def _preview(raw: Mapping[str, Any]) -> PreviewConfig:
    _check_keys("preview.", raw, set(PreviewConfig.__dataclass_fields__))
    if "question" not in raw:
        raise ConfigError("preview.question is required in [preview], got nothing")
    d = PreviewConfig(question="")
    system = raw.get("system", d.system)
    if not isinstance(system, str):
        raise ConfigError(f"preview.system must be a string, got {system!r}")
    return PreviewConfig(
        question=_str("preview.question", raw["question"]),
        system=system,
        max_new_tokens=_int("preview.max_new_tokens", raw.get("max_new_tokens", d.max_new_tokens), minimum=1),
    )


def _tls(raw: Mapping[str, Any], base_dir: Path) -> TlsConfig:
    _check_keys("tls.", raw, {"ca_file", "cert_file", "key_file", "server_name"})
    if ("cert_file" in raw) != ("key_file" in raw):
        given, missing = ("cert_file", "key_file") if "cert_file" in raw else ("key_file", "cert_file")
        raise ConfigError(f"tls.{given} {raw[given]!r} needs tls.{missing} (a client certificate and its key "
                          "go together), got nothing")
    files = {key: _pem_file(f"tls.{key}", raw[key], base_dir) for key in ("ca_file", "cert_file", "key_file")
             if key in raw}
    server_name = _str("tls.server_name", raw["server_name"]) if "server_name" in raw else None
    return TlsConfig(
        ca_file=files["ca_file"][0] if "ca_file" in files else None,
        cert_file=files["cert_file"][0] if "cert_file" in files else None,
        key_file=files["key_file"][0] if "key_file" in files else None,
        server_name=server_name,
        ca_pem=files["ca_file"][1] if "ca_file" in files else None,
        cert_pem=files["cert_file"][1] if "cert_file" in files else None,
        key_pem=files["key_file"][1] if "key_file" in files else None,
    )


def _auth(raw: Mapping[str, Any], base_dir: Path, env: Mapping[str, str]) -> dict[str, str | None]:
    """The bearer token from auth.token_file or auth.token_env; the error names where it was looked
    for, never the token itself."""
    _check_keys("auth.", raw, {"token_file", "token_env"})
    if not raw:
        return {"token": None, "token_source": ""}
    if len(raw) > 1:
        raise ConfigError(f"auth.token_file {raw['token_file']!r} and auth.token_env {raw['token_env']!r} are "
                          "exclusive: give one")
    if "token_file" in raw:
        path = _existing_file("auth.token_file", raw["token_file"], base_dir)
        token, source = path.read_text(encoding="utf-8").strip(), f"auth.token_file {str(path)!r}"
    else:
        name = _str("auth.token_env", raw["token_env"])
        token, source = env.get(name, "").strip(), f"auth.token_env {name!r}"
    if not token:
        raise ConfigError(f"{source} holds no token (empty or unset)")
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ConfigError(f"{source} holds a token with whitespace or non-ASCII characters; a bearer token "
                          "is one printable ASCII word")
    return {"token": token, "token_source": source}


def _existing_file(name: str, value: Any, base_dir: Path) -> Path:
    path = base_dir / Path(_str(name, value)).expanduser()
    if not path.is_file():
        raise ConfigError(f"{name} {value!r} is not a readable file (looked for {str(path)!r})")
    return path


def _pem_file(name: str, value: Any, base_dir: Path) -> tuple[Path, bytes]:
    path = _existing_file(name, value, base_dir)
    data = path.read_bytes()
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{name} {value!r} is not a PEM file (no -----BEGIN line in {str(path)!r})")
    return path, data


# ---- typed field readers: each names the key and the value it rejects ----------------------------


def _check_keys(prefix: str, raw: Mapping[str, Any], allowed: set[str]) -> None:
    for key in raw:
        if key not in allowed:
            raise ConfigError(f"unknown key {prefix}{key} (value {raw[key]!r}); known keys: "
                              f"{', '.join(prefix + k for k in sorted(allowed))}")


def _table(name: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"[{name}] must be a table, got {value!r}")
    return value


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name} must be a non-empty string, got {value!r}")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def _int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value!r}")
    return value


def _float(name: str, value: Any, *, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise ConfigError(f"{name} must be a finite number >= {minimum:g}, got {value!r}")
    return float(value)


def _int_list(name: str, value: Any, *, minimum: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{name} must be a non-empty list of integers, got {value!r}")
    items = tuple(_int(f"{name}[{i}]", item, minimum=minimum) for i, item in enumerate(value))
    if len(set(items)) != len(items):
        raise ConfigError(f"{name} must not repeat a value, got {value!r}")
    return items


def _rate_list(name: str, value: Any) -> tuple[float, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{name} must be a non-empty list of numbers or \"inf\", got {value!r}")
    rates: list[float] = []
    for i, item in enumerate(value):
        if item == "inf":
            rates.append(math.inf)
        elif isinstance(item, bool) or not isinstance(item, (int, float)) or not math.isfinite(item) or item <= 0:
            raise ConfigError(f"{name}[{i}] must be a positive number of requests/s or \"inf\", got {item!r}")
        else:
            rates.append(float(item))
    if len(set(rates)) != len(rates):
        raise ConfigError(f"{name} must not repeat a value, got {value!r}")
    return tuple(rates)
