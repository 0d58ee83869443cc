"""The sweep configuration: one frozen dataclass per concern, read from TOML and validated once.

```toml
target = "127.0.0.1:50051"          # or "ipv4:127.0.0.1:50051,127.0.0.1:50052", "dns:///engine:50051";
                                    # with api = "openai", a base URL: "http://127.0.0.1:8080"
api = "engine.v1"                   # or "openai": an OpenAI-compatible HTTP server (llama-server, vLLM,
                                    # SGLang, TGI), asked POST /v1/completions, ready on GET /health 200
vocab_size = 49152                  # openai, prompt_format "token_ids" only: ids are drawn below it, for a
                                    # server that does not report its vocabulary (text prompts need none)
model = "SmolLM2"                   # openai only: the requests' "model" field (default: the server's own)

[workload]                          # every combination of the lists is one point
dataset = "random"                  # or "sharegpt" (ShareGPT V3, vLLM's semantics: the first human turn is
                                    # the prompt, the first answer's length the output), "jsonl:PATH" (one
                                    # request a line: {"prompt": ...} or {"messages": [...]}, optional max_tokens)
tokenizer = "smollm2"               # optional: a tokenizer.json, a checkpoint folder, a .gguf file or "smollm2";
                                    # without it the server's own tokenize endpoint (said in the log)
prompt_format = "text"              # or "token_ids" (random prompts as ids: engine.v1, llama-server, vLLM)
endpoint = "completions"            # or "chat": messages to /v1/chat/completions (engine.v1: chat)
context_tokens = [64, 256]          # random: prompt lengths in tokens (exact); datasets: not given
range_ratio = 0.0                   # random: lengths uniform in [c*(1-r), c*(1+r)] (vLLM's --random-range-ratio)
prefix_tokens = 0                   # the first N tokens of every prompt are shared (a system prompt,
prefix_groups = 1                   # for prefix caching): 0..min(context_tokens); with G groups, G distinct
                                    # prefixes, request i uses prefix i % G (G > 1 needs prefix_tokens >= 1)
max_new_tokens = [32]               # datasets: optional (default: each request's own length)
concurrency = [1, 8]
request_rate = ["inf"]              # requests/s with Poisson arrivals, or "inf" (all at once)
burstiness = 1.0                    # gamma arrivals of this shape (vLLM's --burstiness; 1 is Poisson)
requests_per_point = 32
duration_s = 60.0                   # optional: no request of a point starts after this many seconds
percentiles = [50, 90, 95, 99]      # the latency percentiles each point reports (and exports)
warmup_requests = 2
seed = 0
ignore_eos = true
temperature = 0.0                   # sampling settings, sent with every request (the server validates them:
top_p = 1.0                         # a refused value skips the point with the server's own message)
top_k = 0

[slo]                               # optional: each point reports goodput (requests/s meeting every SLO)
ttft_ms = 500.0                     # and SLO attainment (the fraction of its requests meeting them)
tpot_ms = 50.0
e2el_ms = 5000.0

[search]                            # optional, needs [slo]: per server, the largest request rate (or
over = "request_rate"               # concurrency) in [low, high] at which `attainment` holds, by bisection:
low = 0.5                           # at most `steps` probes, each a recorded point (resumable); the
high = 16.0                         # searched key's list in [workload] is not used
steps = 6
attainment = 0.9

[policy]                            # how the one policy table is tuned (see policy.py)
max_attempts = 5                    # per request, for retryable statuses
backoff_initial_s = 0.05
backoff_max_s = 2.0
health_wait_s = 30.0                # how long the server may stay down before the sweep stops
request_timeout_s = 120.0
max_error_rate = 0.1                # a point with more failed requests than this is `failed`

[engine]                            # optional: the client starts and stops the server itself
command = ["{python}", "-m", "engine_service", "--model", "tiny", "--host", "127.0.0.1", "--port", "{port}"]
startup_timeout_s = 120.0           # placeholders: bench_client/command.py
drain_timeout_s = 30.0
max_restarts = 1                    # restarts after a crash, per engine configuration
[engine.grid]                       # each combination is one engine configuration
max_batch = [8, 32]                 # `{max_batch}` in the command, or appended as `--max-batch 8`

[preview]                           # optional: before the first point, ask the server one chat question
question = "What is the capital of France?"   # and print the streamed answer (greedy); needs a model
system = "Answer in one sentence."  # with a chat template; optional system message
max_new_tokens = 64

[tls]  [auth]                       # optional: TLS and a bearer token (bench_client/credentials.py)
```

Several servers side by side: instead of the top-level `api`, `target`, `vocab_size`, `model` and
`[engine]`, one table per server, each with those keys (and [engine]'s: `command`, `grid`,
`startup_timeout_s`, ...) directly in it. Every point runs against each server in turn, on the same
prompts; the records name the server.

```toml
[servers.engine]
command = ["{python}", "-m", "engine_service", "--model", "smollm2", "--host", "127.0.0.1", "--port", "{port}"]
[servers.llama-cpp]
api = "openai"
command = ["{llama_server}", "-m", "{smollm2_gguf}", "--no-repack", "--host", "127.0.0.1", "--port", "{port}", "-np", "32"]
grid = { threads = [2] }
[servers.engine-http]               # this engine over its OpenAI-compatible HTTP front (bench_client/fronts.toml)
api = "openai"
command = ["{python}", "-m", "engine_service", "--model", "smollm2", "--host", "127.0.0.1", "--port", "0",
           "--http-port", "{port}"]
```

Relative paths are relative to the configuration file.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_client.command import BUILTIN_PLACEHOLDERS, check_command
from bench_client.config_fields import (
    ConfigError,
    check_keys,
    read_bool,
    read_float,
    read_int,
    read_int_list,
    read_rate_list,
    read_str,
    read_table,
)
from bench_client.credentials import ChannelSecurity, read_security
from bench_client.server_api import APIS, ENGINE_V1, OPENAI

__all__ = ["ConfigError"]  # re-exported: every reader of a configuration catches it from here


RANDOM = "random"
SHAREGPT = "sharegpt"
JSONL_PREFIX = "jsonl:"
TEXT, TOKEN_IDS = "text", "token_ids"
COMPLETIONS, CHAT = "completions", "chat"


@dataclass(frozen=True)
class WorkloadConfig:
    context_tokens: tuple[int, ...]  # random: the prompt lengths; (0,) for a dataset: its own lengths
    max_new_tokens: tuple[int, ...]  # (0,) for a dataset without an override: each request's own
    concurrency: tuple[int, ...]
    request_rate: tuple[float, ...] = (float("inf"),)
    requests_per_point: int = 16
    warmup_requests: int = 1
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    prefix_tokens: int = 0  # the first prefix_tokens of every prompt are one of prefix_groups shared prefixes
    prefix_groups: int = 1
    dataset: str = RANDOM  # "random", "sharegpt" or "jsonl:PATH" (the path made absolute)
    tokenizer: str | None = None  # None: the server's own tokenize endpoint
    prompt_format: str = TEXT
    endpoint: str = COMPLETIONS
    range_ratio: float = 0.0
    burstiness: float = 1.0
    duration_s: float | None = None
    percentiles: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)


@dataclass(frozen=True)
class SLOConfig:
    """Service-level objectives in milliseconds (None: not set); a request meets them when every one
    set holds (vLLM's --goodput: TTFT, TPOT and E2EL of the request)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms), ("e2el_ms", self.e2el_ms))
                if v is not None}


REQUEST_RATE, CONCURRENCY = "request_rate", "concurrency"


@dataclass(frozen=True)
class SearchConfig:
    """The SLO search: the largest value of `over` in [low, high] whose attainment >= `attainment`."""

    over: str
    low: float
    high: float
    steps: int = 6
    attainment: float = 0.9


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
class SweepServerConfig:
    """One server of the sweep: its API, and either a running target or a command that starts it."""

    name: str  # the [servers.NAME] table's name; "" for the one server of a config without [servers]
    api: str = ENGINE_V1
    target: str = ""  # "" when `launch` starts the server (the runner fills in its address)
    launch: EngineLaunchConfig | None = None
    vocab_size: int | None = None  # openai: for a server that does not report its vocabulary
    model: str | None = None  # openai: the requests' "model" field


@dataclass(frozen=True)
class PreviewConfig:
    """One chat question asked before the sweep's first point, its answer printed (bench_client.chat)."""

    question: str
    system: str = ""
    max_new_tokens: int = 64


@dataclass(frozen=True)
class SweepConfig:
    servers: tuple[SweepServerConfig, ...]
    workload: WorkloadConfig
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    security: ChannelSecurity = field(default_factory=ChannelSecurity)
    preview: PreviewConfig | None = None
    slo: SLOConfig | None = None
    search: SearchConfig | None = None


# ---- reading -------------------------------------------------------------------------------------

_SERVER_KEYS = {"api", "target", "vocab_size", "model"}
_LAUNCH_KEYS = set(EngineLaunchConfig.__dataclass_fields__)
_SERVER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


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
    check_keys("", raw, {*_SERVER_KEYS, "servers", "workload", "policy", "engine", "tls", "auth", "preview", "slo",
                         "search"})
    if "servers" in raw:
        alone = sorted(key for key in (*_SERVER_KEYS, "engine") if key in raw)
        if alone:
            raise ConfigError(f"[servers] and the top-level {', '.join(alone)} are exclusive: give each server "
                              f"its own table, got both (top-level {alone[0]} = {raw[alone[0]]!r})")
        servers_raw = read_table("servers", raw["servers"])
        if not servers_raw:
            raise ConfigError("[servers] must name at least one server, got an empty table")
        servers = tuple(_named_server(name, value) for name, value in servers_raw.items())
    else:
        engine = read_table("engine", raw["engine"]) if "engine" in raw else None
        servers = (_server("", "", {key: raw[key] for key in _SERVER_KEYS if key in raw}, engine),)
    if "workload" not in raw:
        raise ConfigError("[workload] is required, got nothing")
    workload = _workload(read_table("workload", raw["workload"]), base_dir or Path.cwd())
    slo = _slo(read_table("slo", raw["slo"])) if "slo" in raw else None
    search = _search(read_table("search", raw["search"]), slo) if "search" in raw else None
    if workload.prompt_format == TOKEN_IDS and workload.endpoint == CHAT:
        raise ConfigError("workload.prompt_format 'token_ids' and workload.endpoint 'chat' are exclusive: chat "
                          "messages are text, got both")
    if workload.prompt_format == TOKEN_IDS and workload.dataset != RANDOM:
        raise ConfigError(f"workload.prompt_format 'token_ids' applies to dataset 'random' only (a dataset's "
                          f"prompts are text), got dataset {workload.dataset!r}")
    return SweepConfig(
        servers=servers,
        workload=workload,
        policy=_policy(read_table("policy", raw.get("policy", {}))),
        security=read_security(raw, base_dir or Path.cwd(), os.environ if env is None else env),
        preview=_preview(read_table("preview", raw["preview"])) if "preview" in raw else None,
        slo=slo,
        search=search,
    )


def _named_server(name: str, value: Any) -> SweepServerConfig:
    if not _SERVER_NAME.fullmatch(name):
        raise ConfigError(f"servers.{name} must be named with letters, digits, '-', '_' or '.' (at most 64), "
                          f"got {name!r}")
    table = read_table(f"servers.{name}", value)
    check_keys(f"servers.{name}.", table, _SERVER_KEYS | _LAUNCH_KEYS)
    launch = {key: table[key] for key in _LAUNCH_KEYS if key in table}
    return _server(name, f"servers.{name}.", {key: table[key] for key in _SERVER_KEYS if key in table},
                   launch or None)


def _server(name: str, prefix: str, raw: Mapping[str, Any], launch_raw: Mapping[str, Any] | None) -> SweepServerConfig:
    api = read_str(f"{prefix}api", raw.get("api", ENGINE_V1))
    if api not in APIS:
        raise ConfigError(f"{prefix}api must be one of {', '.join(repr(a) for a in APIS)}, got {api!r}")
    launch = _launch(prefix or "engine.", launch_raw) if launch_raw is not None else None
    where = f"[{prefix.rstrip('.')}]" if prefix else "[engine]"
    if "target" in raw:
        target = read_str(f"{prefix}target", raw["target"])
        if launch is not None:
            raise ConfigError(f"{prefix}target {target!r} and {where}'s command are exclusive: with a command the "
                              "client starts the server itself and targets it")
        if api == OPENAI and not target.startswith(("http://", "https://")):
            raise ConfigError(f"{prefix}target must be a base URL such as 'http://127.0.0.1:8080' with "
                              f"api = 'openai', got {target!r}")
    elif launch is None:
        raise ConfigError(f"{prefix}target is required when there is no {where} command, got nothing")
    else:
        target = ""  # filled in per managed server
    for key in ("vocab_size", "model"):
        if key in raw and api != OPENAI:
            raise ConfigError(f"{prefix}{key} applies to api = 'openai' only (engine.v1 reports its own), "
                              f"got {raw[key]!r} with api {api!r}")
    return SweepServerConfig(
        name=name, api=api, target=target, launch=launch,
        vocab_size=read_int(f"{prefix}vocab_size", raw["vocab_size"], minimum=2) if "vocab_size" in raw else None,
        model=read_str(f"{prefix}model", raw["model"]) if "model" in raw else None,
    )


def _launch(prefix: str, raw: Mapping[str, Any]) -> EngineLaunchConfig:
    if prefix == "engine.":
        check_keys(prefix, raw, _LAUNCH_KEYS)
    if "command" not in raw:
        raise ConfigError(f"{prefix}command is required to start the server, got nothing")
    grid_raw = read_table(f"{prefix}grid", raw.get("grid", {}))
    grid: list[tuple[str, tuple[Any, ...]]] = []
    for key, values in grid_raw.items():
        name = f"{prefix}grid.{key}"
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
    d = EngineLaunchConfig(command=())
    return EngineLaunchConfig(
        command=check_command(f"{prefix}command", raw["command"], [key for key, _ in grid]),
        grid=tuple(grid),
        startup_timeout_s=read_float(f"{prefix}startup_timeout_s", raw.get("startup_timeout_s", d.startup_timeout_s),
                                     minimum=0.1),
        drain_timeout_s=read_float(f"{prefix}drain_timeout_s", raw.get("drain_timeout_s", d.drain_timeout_s),
                                   minimum=0.1),
        max_restarts=read_int(f"{prefix}max_restarts", raw.get("max_restarts", d.max_restarts), minimum=0),
        log_tail_lines=read_int(f"{prefix}log_tail_lines", raw.get("log_tail_lines", d.log_tail_lines), minimum=0),
    )


def _workload(raw: Mapping[str, Any], base_dir: Path) -> WorkloadConfig:
    check_keys("workload.", raw, set(WorkloadConfig.__dataclass_fields__))
    defaults = WorkloadConfig((1,), (1,), (1,))
    dataset = _dataset(raw.get("dataset", RANDOM), base_dir)
    random_prompts = dataset == RANDOM
    required = ("context_tokens", "max_new_tokens", "concurrency") if random_prompts else ("concurrency",)
    for key in required:
        if key not in raw:
            raise ConfigError(f"workload.{key} is required, got nothing")
    if not random_prompts:
        for key in ("context_tokens", "range_ratio", "prefix_tokens", "prefix_groups"):
            if key in raw:
                raise ConfigError(f"workload.{key} applies to dataset 'random' only (dataset {dataset!r} gives "
                                  f"its own prompts), got {raw[key]!r}")
    config = WorkloadConfig(
        context_tokens=read_int_list("workload.context_tokens", raw["context_tokens"], minimum=1)
        if random_prompts else (0,),
        max_new_tokens=read_int_list("workload.max_new_tokens", raw["max_new_tokens"], minimum=1)
        if "max_new_tokens" in raw else (0,),
        concurrency=read_int_list("workload.concurrency", raw["concurrency"], minimum=1),
        request_rate=read_rate_list("workload.request_rate", raw.get("request_rate", ["inf"])),
        requests_per_point=read_int("workload.requests_per_point",
                                raw.get("requests_per_point", defaults.requests_per_point), minimum=1),
        warmup_requests=read_int("workload.warmup_requests", raw.get("warmup_requests", defaults.warmup_requests),
                             minimum=0),
        seed=read_int("workload.seed", raw.get("seed", defaults.seed), minimum=0),
        ignore_eos=read_bool("workload.ignore_eos", raw.get("ignore_eos", defaults.ignore_eos)),
        temperature=read_float("workload.temperature", raw.get("temperature", defaults.temperature), minimum=0.0),
        top_p=read_float("workload.top_p", raw.get("top_p", defaults.top_p), minimum=0.0),
        top_k=read_int("workload.top_k", raw.get("top_k", defaults.top_k), minimum=0),
        prefix_tokens=read_int("workload.prefix_tokens", raw.get("prefix_tokens", defaults.prefix_tokens), minimum=0),
        prefix_groups=read_int("workload.prefix_groups", raw.get("prefix_groups", defaults.prefix_groups), minimum=1),
        dataset=dataset,
        tokenizer=_tokenizer(raw["tokenizer"], base_dir) if "tokenizer" in raw else None,
        prompt_format=read_choice("workload.prompt_format", raw.get("prompt_format", TEXT), (TEXT, TOKEN_IDS)),
        endpoint=read_choice("workload.endpoint", raw.get("endpoint", COMPLETIONS), (COMPLETIONS, CHAT)),
        range_ratio=read_float("workload.range_ratio", raw.get("range_ratio", defaults.range_ratio), minimum=0.0),
        burstiness=read_float("workload.burstiness", raw.get("burstiness", defaults.burstiness), minimum=0.0),
        duration_s=read_float("workload.duration_s", raw["duration_s"], minimum=0.001) if "duration_s" in raw else None,
        percentiles=_percentiles(raw.get("percentiles", list(defaults.percentiles))),
    )
    if config.range_ratio >= 1.0:
        raise ConfigError(f"workload.range_ratio must be in [0, 1) (lengths from c*(1-r) to c*(1+r)), "
                          f"got {config.range_ratio!r}")
    if config.burstiness <= 0.0:
        raise ConfigError(f"workload.burstiness must be > 0 (the gamma shape; 1 is Poisson), got {config.burstiness!r}")
    if config.prefix_tokens > min(config.context_tokens):
        raise ConfigError(f"workload.prefix_tokens must be <= every workload.context_tokens value (the prefix is "
                          f"part of the prompt; smallest {min(config.context_tokens)}), got {config.prefix_tokens!r}")
    if config.prefix_groups > 1 and config.prefix_tokens == 0:
        raise ConfigError(f"workload.prefix_groups {config.prefix_groups!r} needs workload.prefix_tokens >= 1 "
                          "(groups of an empty prefix share nothing), got prefix_tokens 0")
    return config


def read_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return str(value)


def _dataset(value: Any, base_dir: Path) -> str:
    text = read_str("workload.dataset", value)
    if text in (RANDOM, SHAREGPT):
        return text
    if text.startswith(JSONL_PREFIX) and len(text) > len(JSONL_PREFIX):
        path = Path(text[len(JSONL_PREFIX):]).expanduser()
        path = path if path.is_absolute() else base_dir / path
        if not path.is_file():
            raise ConfigError(f"workload.dataset {text!r}: the file {str(path)!r} does not exist")
        return JSONL_PREFIX + str(path)
    raise ConfigError(f"workload.dataset must be 'random', 'sharegpt' or 'jsonl:PATH', got {text!r}")


def _tokenizer(value: Any, base_dir: Path) -> str:
    """A named tokenizer: "smollm2", or a path (made absolute; what it holds is checked when loaded)."""
    text = read_str("workload.tokenizer", value)
    if text == "smollm2":
        return text
    path = Path(text).expanduser()
    return str(path if path.is_absolute() else base_dir / path)


def _percentiles(value: Any) -> tuple[float, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"workload.percentiles must be a non-empty list of numbers in (0, 100], got {value!r}")
    items = tuple(read_float(f"workload.percentiles[{i}]", v, minimum=0.0) for i, v in enumerate(value))
    for i, item in enumerate(items):
        if not 0.0 < item <= 100.0:
            raise ConfigError(f"workload.percentiles[{i}] must be in (0, 100], got {value[i]!r}")
    if len(set(items)) != len(items):
        raise ConfigError(f"workload.percentiles must not repeat a value, got {value!r}")
    return tuple(sorted(items))


def _slo(raw: Mapping[str, Any]) -> SLOConfig:
    check_keys("slo.", raw, set(SLOConfig.__dataclass_fields__))
    if not raw:
        raise ConfigError("[slo] must set at least one of slo.ttft_ms, slo.tpot_ms, slo.e2el_ms, got an empty table")
    values = {key: read_float(f"slo.{key}", raw[key], minimum=0.0) for key in raw}
    for key, number in values.items():
        if number <= 0:
            raise ConfigError(f"slo.{key} must be > 0 milliseconds, got {raw[key]!r}")
    return SLOConfig(**values)


def _search(raw: Mapping[str, Any], slo: SLOConfig | None) -> SearchConfig:
    check_keys("search.", raw, set(SearchConfig.__dataclass_fields__))
    if slo is None:
        raise ConfigError("[search] needs [slo]: the search looks for the largest load at which the SLOs hold, "
                          "got no [slo]")
    for key in ("over", "low", "high"):
        if key not in raw:
            raise ConfigError(f"search.{key} is required, got nothing")
    d = SearchConfig(over=REQUEST_RATE, low=1.0, high=2.0)
    over = read_choice("search.over", raw["over"], (REQUEST_RATE, CONCURRENCY))
    if over == CONCURRENCY:
        low: float = read_int("search.low", raw["low"], minimum=1)
        high: float = read_int("search.high", raw["high"], minimum=1)
    else:
        low = read_float("search.low", raw["low"], minimum=0.0)
        high = read_float("search.high", raw["high"], minimum=0.0)
        if low <= 0:
            raise ConfigError(f"search.low must be > 0 requests/s, got {raw['low']!r}")
    if high <= low:
        raise ConfigError(f"search.high must be > search.low {raw['low']!r}, got {raw['high']!r}")
    config = SearchConfig(
        over=over, low=low, high=high,
        steps=read_int("search.steps", raw.get("steps", d.steps), minimum=2),
        attainment=read_float("search.attainment", raw.get("attainment", d.attainment), minimum=0.0),
    )
    if not 0.0 < config.attainment <= 1.0:
        raise ConfigError(f"search.attainment must be in (0, 1], got {config.attainment!r}")
    if config.steps > 20:
        raise ConfigError(f"search.steps must be <= 20 (each is a whole point), got {config.steps!r}")
    return config

def _policy(raw: Mapping[str, Any]) -> PolicyConfig:
    check_keys("policy.", raw, set(PolicyConfig.__dataclass_fields__))
    d = PolicyConfig()
    config = PolicyConfig(
        max_attempts=read_int("policy.max_attempts", raw.get("max_attempts", d.max_attempts), minimum=1),
        backoff_initial_s=read_float("policy.backoff_initial_s", raw.get("backoff_initial_s", d.backoff_initial_s),
                                 minimum=0.0),
        backoff_max_s=read_float("policy.backoff_max_s", raw.get("backoff_max_s", d.backoff_max_s), minimum=0.0),
        health_wait_s=read_float("policy.health_wait_s", raw.get("health_wait_s", d.health_wait_s), minimum=0.0),
        request_timeout_s=read_float("policy.request_timeout_s", raw.get("request_timeout_s", d.request_timeout_s),
                                 minimum=0.001),
        max_error_rate=read_float("policy.max_error_rate", raw.get("max_error_rate", d.max_error_rate), minimum=0.0),
    )
    if config.max_error_rate > 1.0:
        raise ConfigError(f"policy.max_error_rate must be in [0, 1], got {config.max_error_rate!r}")
    if config.backoff_max_s < config.backoff_initial_s:
        raise ConfigError(f"policy.backoff_max_s must be >= policy.backoff_initial_s "
                          f"{config.backoff_initial_s!r}, got {config.backoff_max_s!r}")
    return config

def _preview(raw: Mapping[str, Any]) -> PreviewConfig:
    check_keys("preview.", raw, set(PreviewConfig.__dataclass_fields__))
    if "question" not in raw:
        raise ConfigError("preview.question is required in [preview], got nothing")
    d = PreviewConfig(question="")
    system = raw.get("system", d.system)
    if not isinstance(system, str):
        raise ConfigError(f"preview.system must be a string, got {system!r}")
    return PreviewConfig(
        question=read_str("preview.question", raw["question"]),
        system=system,
        max_new_tokens=read_int("preview.max_new_tokens", raw.get("max_new_tokens", d.max_new_tokens), minimum=1),
    )
