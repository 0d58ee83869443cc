"""Sweep configuration: the demo loads; unknown keys, wrong types and impossible values are refused
with a message naming the key and the value, and the CLI exits 2."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest

from bench_client.__main__ import main, sweep_main
from bench_client.command import build_command
from bench_client.config import ConfigError, PreviewConfig, load_config, parse_config
from bench_client.engine_process import engine_configurations

DEMO = Path(__file__).resolve().parent.parent / "bench_client" / "demo.toml"


def base(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {"target": "127.0.0.1:1",
                           "workload": {"context_tokens": [8], "max_new_tokens": [4], "concurrency": [1]}}
    raw.update(overrides)
    return raw


def test_demo_config_replays_sharegpt_within_the_engines_context() -> None:
    config = load_config(DEMO)
    launch = config.servers[0].launch
    assert launch is not None
    command = " ".join(launch.command)
    max_context = int(command.split("--max-context")[1].split()[0])
    w = config.workload
    assert (w.dataset, w.tokenizer, w.context_tokens) == ("sharegpt", "smollm2", (0,))
    # vLLM's ShareGPT filter keeps prompts of at most 1,024 tokens: each fits with its new tokens
    assert 1024 + max(w.max_new_tokens) <= max_context
    assert config.slo is not None and config.slo.as_dict()  # goodput in the table
    assert config.workload.ignore_eos
    assert config.preview is not None and config.preview.question  # and a real answer first


def test_defaults_and_inf_rate() -> None:
    config = parse_config(base(workload={"context_tokens": [8, 16], "max_new_tokens": [4], "concurrency": [1, 2],
                                         "request_rate": [2, "inf"]}))
    assert config.workload.request_rate == (2.0, math.inf)
    assert config.policy.max_attempts >= 1
    assert [(s.name, s.api, s.target, s.launch) for s in config.servers] == [("", "engine.v1", "127.0.0.1:1", None)]


@pytest.mark.parametrize(("raw", "message"), [
    (base(targte="x"), "unknown key targte (value 'x')"),
    (base(workload={"context_tokens": [8], "max_new_tokens": [4], "concurrency": [1], "concurency": [2]}),
     "unknown key workload.concurency (value [2])"),
    (base(workload={"context_tokens": [8], "max_new_tokens": [4], "concurrency": [0]}),
     "workload.concurrency[0] must be >= 1, got 0"),
    (base(workload={"context_tokens": "8", "max_new_tokens": [4], "concurrency": [1]}),
     "workload.context_tokens must be a non-empty list of integers, got '8'"),
    (base(workload={"context_tokens": [8], "max_new_tokens": [4], "concurrency": [1], "request_rate": [0]}),
     "workload.request_rate[0] must be a positive number of requests/s or \"inf\", got 0"),
    (base(workload={"context_tokens": [8], "max_new_tokens": [4], "concurrency": [1], "ignore_eos": "yes"}),
     "workload.ignore_eos must be true or false, got 'yes'"),
    (base(workload={"context_tokens": [8, 8], "max_new_tokens": [4], "concurrency": [1]}),
     "workload.context_tokens must not repeat a value"),
    (base(workload={"max_new_tokens": [4], "concurrency": [1]}), "workload.context_tokens is required"),
    (base(policy={"max_error_rate": 1.5}), "policy.max_error_rate must be in [0, 1], got 1.5"),
    (base(policy={"health_wait_s": True}), "policy.health_wait_s must be a number, got True"),
    ({"workload": base()["workload"]}, "target is required"),
    (base(engine={"command": ["x", "{port}"]}), "target '127.0.0.1:1' and [engine]'s command are exclusive"),
    (base(api="grpc"), "api must be one of 'engine.v1', 'openai', got 'grpc'"),
    (base(api="openai"), "target must be a base URL such as 'http://127.0.0.1:8080' with api = 'openai', "
                         "got '127.0.0.1:1'"),
    (base(vocab_size=100), "vocab_size applies to api = 'openai' only (engine.v1 reports its own), got 100"),
    (base(servers={"a": {"target": "127.0.0.1:2"}}), "[servers] and the top-level target are exclusive"),
    ({"servers": {}, "workload": base()["workload"]}, "[servers] must name at least one server"),
    ({"servers": {"a b": {"target": "x:1"}}, "workload": base()["workload"]},
     "servers.a b must be named with letters, digits"),
    ({"servers": {"a": {"target": "x:1", "comand": ["x"]}}, "workload": base()["workload"]},
     "unknown key servers.a.comand"),
    ({"servers": {"a": {"api": "openai"}}, "workload": base()["workload"]},
     "servers.a.target is required when there is no [servers.a] command, got nothing"),
    ({"servers": {"a": {"api": "openai", "command": ["srv"]}}, "workload": base()["workload"]},
     "servers.a.command must contain the placeholder {port}"),
])
def test_bad_values_are_named(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(raw)


@pytest.mark.parametrize(("engine", "message"), [
    ({"command": ["engine", "--port", "{port}", "{max_btch}"], "grid": {"max_batch": [1]}},
     "placeholder {max_btch} is neither a builtin"),
    ({"command": ["engine"]}, "must contain the placeholder {port}"),
    ({"command": ["engine", "{port}"], "grid": {"port": [1]}}, "engine.grid.port is reserved"),
    ({"command": ["engine", "{port}"], "grid": {"max_batch": []}}, "engine.grid.max_batch must be a non-empty list"),
    ({"command": ["engine", "{port}"], "startup_timeout": 3}, "unknown key engine.startup_timeout"),
])
def test_engine_table_errors(engine: dict[str, Any], message: str) -> None:
    raw = base(engine=engine)
    del raw["target"]
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(raw)


def test_engine_grid_and_command_template() -> None:
    raw = base(engine={"command": ["{python}", "-m", "engine_service", "--port", "{port}", "--max-context",
                                   "{max_context}"],
                       "grid": {"max_context": [128, 256], "max_batch": [4]}})
    del raw["target"]
    launch = parse_config(raw).servers[0].launch
    assert launch is not None
    configs = engine_configurations(launch)
    assert configs == [{"max_context": 128, "max_batch": 4}, {"max_context": 256, "max_batch": 4}]
    command = build_command(launch.command, configs[0], port=5555)
    assert command[1:] == ["-m", "engine_service", "--port", "5555", "--max-context", "128", "--max-batch", "4"]


def test_servers_side_by_side_each_with_its_api_and_grid() -> None:
    config = parse_config({
        "servers": {
            "engine": {"command": ["{python}", "-m", "engine_service", "--port", "{port}"], "grid": {"max_batch": [8]}},
            "llama-cpp": {"api": "openai", "command": ["{llama_server}", "-m", "{smollm2_gguf}", "--port", "{port}"],
                          "startup_timeout_s": 60},
            "vllm": {"api": "openai", "target": "http://127.0.0.1:8000", "vocab_size": 49152, "model": "smol"},
        },
        "workload": base()["workload"]})
    engine, llama, vllm = config.servers
    assert (engine.name, engine.api, engine.target) == ("engine", "engine.v1", "")
    assert engine.launch is not None and engine.launch.grid == (("max_batch", (8,)),)
    assert (llama.name, llama.api) == ("llama-cpp", "openai")
    assert llama.launch is not None and llama.launch.startup_timeout_s == 60.0
    assert (vllm.target, vllm.vocab_size, vllm.model, vllm.launch) == ("http://127.0.0.1:8000", 49152, "smol", None)


def test_the_engines_sampling_rules_are_the_engines() -> None:
    """The client does not copy the engine's range checks: a refused value skips the point with the
    server's own message (a type error is still the config's)."""
    config = parse_config(base(workload={"context_tokens": [8], "max_new_tokens": [4], "concurrency": [1],
                                         "top_p": 2.0, "temperature": 200}))
    assert (config.workload.top_p, config.workload.temperature) == (2.0, 200.0)


def test_cli_exits_2_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('target = "127.0.0.1:1"\n[workload]\ncontext_tokens = [8]\nmax_new_tokens = [4]\n'
                   'concurrency = [1]\nwarmup_requests = -1\n')
    assert main(["sweep", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "workload.warmup_requests must be >= 0, got -1" in capsys.readouterr().err
    assert main(["sweep", str(tmp_path / "missing.toml"), "--out", str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad.write_text("target = \n")
    assert main(["sweep", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "is not valid TOML" in capsys.readouterr().err


def test_cli_refuses_non_empty_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "results.jsonl").write_text("")
    assert main(["sweep", str(DEMO), "--out", str(tmp_path / "out")]) == 2
    assert "is not empty; pass --resume" in capsys.readouterr().err


def test_console_script_takes_the_sweep_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert sweep_main([str(tmp_path / "missing.toml"), "--out", str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---- [tls] and [auth] ------------------------------------------------------------------------------


@pytest.fixture
def pem_files(tmp_path: Path) -> Path:
    for name in ("ca.pem", "client.pem", "client.key"):
        (tmp_path / name).write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    (tmp_path / "token").write_text("  t0ken-value\n")
    (tmp_path / "not-pem.txt").write_text("hello\n")
    return tmp_path


def test_tls_and_token_file_paths_are_relative_to_the_config(pem_files: Path) -> None:
    config_file = pem_files / "sweep.toml"
    config_file.write_text('target = "127.0.0.1:1"\n[workload]\ncontext_tokens = [8]\nmax_new_tokens = [4]\n'
                           'concurrency = [1]\n[tls]\nca_file = "ca.pem"\ncert_file = "client.pem"\n'
                           'key_file = "client.key"\nserver_name = "engine.internal"\n[auth]\ntoken_file = "token"\n')
    security = load_config(config_file).security
    assert security.tls is not None and security.tls.ca_file == pem_files / "ca.pem"
    assert security.tls.cert_pem is not None and security.tls.key_pem is not None
    assert security.tls.server_name == "engine.internal"
    assert security.token == "t0ken-value"  # surrounding whitespace stripped
    assert "t0ken-value" not in repr(security) and "t0ken-value" not in security.token_source


def test_token_from_an_environment_variable(pem_files: Path) -> None:
    config = parse_config(base(auth={"token_env": "SWEEP_TOKEN"}), env={"SWEEP_TOKEN": "abc"})
    assert config.security.token == "abc" and config.security.tls is None
    assert parse_config(base()).security.token is None


def test_an_empty_tls_table_uses_the_system_roots() -> None:
    tls = parse_config(base(tls={})).security.tls
    assert tls is not None and tls.ca_pem is None and tls.cert_pem is None


@pytest.mark.parametrize(("overrides", "message"), [
    ({"tls": {"ca": "ca.pem"}}, "unknown key tls.ca (value 'ca.pem')"),
    ({"tls": {"ca_file": "missing.pem"}}, "tls.ca_file 'missing.pem' is not a readable file"),
    ({"tls": {"ca_file": "not-pem.txt"}}, "tls.ca_file 'not-pem.txt' is not a PEM file"),
    ({"tls": {"ca_file": 5}}, "tls.ca_file must be a non-empty string, got 5"),
    ({"tls": {"cert_file": "client.pem"}}, "tls.cert_file 'client.pem' needs tls.key_file"),
    ({"tls": {"key_file": "client.key"}}, "tls.key_file 'client.key' needs tls.cert_file"),
    ({"tls": {"server_name": ""}}, "tls.server_name must be a non-empty string, got ''"),
    ({"tls": "yes"}, "[tls] must be a table, got 'yes'"),
    ({"auth": {"token": "literal"}}, "unknown key auth.token (value 'literal')"),
    ({"auth": {"token_file": "missing"}}, "auth.token_file 'missing' is not a readable file"),
    ({"auth": {"token_env": "UNSET_VARIABLE"}}, "auth.token_env 'UNSET_VARIABLE' holds no token"),
    ({"auth": {"token_env": "SPACED"}}, "auth.token_env 'SPACED' holds a token with whitespace"),
    ({"auth": {"token_env": "SWEEP_TOKEN", "token_file": "token"}},
     "auth.token_file 'token' and auth.token_env 'SWEEP_TOKEN' are exclusive"),
    ({"auth": {"token_env": ["A"]}}, "auth.token_env must be a non-empty string, got ['A']"),
])
def test_bad_tls_and_auth_values_are_named(pem_files: Path, overrides: dict[str, Any], message: str) -> None:
    env = {"SWEEP_TOKEN": "abc", "SPACED": "two words"}
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(base(**overrides), base_dir=pem_files, env=env)


@pytest.mark.parametrize(("raw", "message"), [
    (base(target=5), "target must be a non-empty string, got 5"),
    (base(target=""), "target must be a non-empty string, got ''"),
    (base(workload=[1]), "[workload] must be a table, got [1]"),
    (base(policy="fast"), "[policy] must be a table, got 'fast'"),
    (base(policy={"retries": 3}), "unknown key policy.retries (value 3)"),
    (base(policy={"max_attempts": 0}), "policy.max_attempts must be >= 1, got 0"),
    (base(policy={"request_timeout_s": 0}), "policy.request_timeout_s must be a finite number >= 0.001, got 0"),
    (base(policy={"backoff_initial_s": 1.0, "backoff_max_s": 0.5}),
     "policy.backoff_max_s must be >= policy.backoff_initial_s 1.0, got 0.5"),
    (base(policy={"health_wait_s": math.inf}), "policy.health_wait_s must be a finite number >= 0, got inf"),
    (base(workload={"context_tokens": [8], "max_new_tokens": [4], "concurrency": [1], "requests_per_point": 1.5}),
     "workload.requests_per_point must be an integer, got 1.5"),
    (base(workload={"context_tokens": [8], "max_new_tokens": [4], "concurrency": [1], "top_k": -1}),
     "workload.top_k must be >= 0, got -1"),
    (base(workload={"context_tokens": [8], "max_new_tokens": [True], "concurrency": [1]}),
     "workload.max_new_tokens[0] must be an integer, got True"),
    (base(workload={"context_tokens": [8], "max_new_tokens": [4], "concurrency": [1], "request_rate": "inf"}),
     "workload.request_rate must be a non-empty list of numbers or \"inf\", got 'inf'"),
])
def test_more_bad_values_are_named(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(raw)


@pytest.mark.parametrize(("engine", "message"), [
    ({"command": "engine {port}"}, "engine.command must be a non-empty list of strings, got 'engine {port}'"),
    ({"command": ["engine", "{port}"], "grid": [1]}, "[engine.grid] must be a table, got [1]"),
    ({"command": ["engine", "{port}"], "grid": {"max-batch": [1]}}, "engine.grid.max-batch must be an identifier"),
    ({"command": ["engine", "{port}"], "grid": {"max_batch": [[1]]}},
     "engine.grid.max_batch values must be strings, numbers or booleans, got [1]"),
    ({"command": ["engine", "{port}"], "max_restarts": -1}, "engine.max_restarts must be >= 0, got -1"),
    ({}, "engine.command is required to start the server, got nothing"),
])
def test_more_engine_table_errors(engine: dict[str, Any], message: str) -> None:
    raw = base(engine=engine)
    del raw["target"]
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(raw)


def test_cli_exits_2_on_a_missing_certificate_before_any_request(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "sweep.toml"
    config.write_text('target = "127.0.0.1:1"\n[workload]\ncontext_tokens = [8]\nmax_new_tokens = [4]\n'
                      'concurrency = [1]\n[tls]\nca_file = "nowhere/ca.pem"\n')
    assert main(["sweep", str(config), "--out", str(tmp_path / "out")]) == 2
    assert f"tls.ca_file 'nowhere/ca.pem' is not a readable file (looked for '{tmp_path}/nowhere/ca.pem')" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # stopped before the results directory, and before any request


def test_the_preview_table() -> None:
    assert parse_config(base()).preview is None
    config = parse_config(base(preview={"question": "Why?", "system": "Be brief.", "max_new_tokens": 8}))
    assert config.preview == PreviewConfig(question="Why?", system="Be brief.", max_new_tokens=8)
    assert parse_config(base(preview={"question": "Why?"})).preview == PreviewConfig(question="Why?")


@pytest.mark.parametrize(("preview", "message"), [
    ({}, "preview.question is required in [preview], got nothing"),
    ({"question": ""}, "preview.question must be a non-empty string, got ''"),
    ({"question": "Why?", "system": 3}, "preview.system must be a string, got 3"),
    ({"question": "Why?", "max_new_tokens": 0}, "preview.max_new_tokens must be >= 1, got 0"),
    ({"question": "Why?", "temperature": 1.0}, "unknown key preview.temperature (value 1.0)"),
    ("Why?", "[preview] must be a table, got 'Why?'"),
])
def test_preview_errors_are_named(preview: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(base(preview=preview))


# ---- workload.prefix_tokens and workload.prefix_groups ----------------------------------------------


def prefixed(**keys: Any) -> dict[str, Any]:
    return base(workload={"context_tokens": [64, 256], "max_new_tokens": [4], "concurrency": [1], **keys})


def test_prefix_defaults_and_accepted_values() -> None:
    workload = parse_config(prefixed()).workload
    assert (workload.prefix_tokens, workload.prefix_groups) == (0, 1)
    workload = parse_config(prefixed(prefix_tokens=48, prefix_groups=4)).workload
    assert (workload.prefix_tokens, workload.prefix_groups) == (48, 4)
    # equal to the smallest context: the unique part of those prompts is empty, which is allowed
    assert parse_config(prefixed(prefix_tokens=64)).workload.prefix_tokens == 64
    assert parse_config(prefixed(prefix_tokens=0, prefix_groups=1)).workload.prefix_groups == 1


@pytest.mark.parametrize(("keys", "message"), [
    ({"prefix_tokens": 65},
     "workload.prefix_tokens must be <= every workload.context_tokens value (the prefix is part of the prompt; "
     "smallest 64), got 65"),
    ({"prefix_tokens": 300, "prefix_groups": 2}, "workload.prefix_tokens must be <= every workload.context_tokens "
                                                 "value (the prefix is part of the prompt; smallest 64), got 300"),
    ({"prefix_tokens": -1}, "workload.prefix_tokens must be >= 0, got -1"),
    ({"prefix_tokens": 8.0}, "workload.prefix_tokens must be an integer, got 8.0"),
    ({"prefix_tokens": "8"}, "workload.prefix_tokens must be an integer, got '8'"),
    ({"prefix_tokens": [8, 16]}, "workload.prefix_tokens must be an integer, got [8, 16]"),
    ({"prefix_tokens": True}, "workload.prefix_tokens must be an integer, got True"),
    ({"prefix_tokens": 8, "prefix_groups": 0}, "workload.prefix_groups must be >= 1, got 0"),
    ({"prefix_tokens": 8, "prefix_groups": -2}, "workload.prefix_groups must be >= 1, got -2"),
    ({"prefix_tokens": 8, "prefix_groups": 2.5}, "workload.prefix_groups must be an integer, got 2.5"),
    ({"prefix_tokens": 8, "prefix_groups": False}, "workload.prefix_groups must be an integer, got False"),
    ({"prefix_groups": 3},
     "workload.prefix_groups 3 needs workload.prefix_tokens >= 1 (groups of an empty prefix share nothing), "
     "got prefix_tokens 0"),
    ({"prefix_tokens": 0, "prefix_groups": 2}, "workload.prefix_groups 2 needs workload.prefix_tokens >= 1"),
    ({"prefix_token": 8}, "unknown key workload.prefix_token (value 8)"),
])
def test_bad_prefix_values_are_named(keys: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(prefixed(**keys))


def test_cli_exits_2_on_a_prefix_longer_than_a_context(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('target = "127.0.0.1:1"\n[workload]\ncontext_tokens = [80, 32]\nmax_new_tokens = [4]\n'
                   'concurrency = [1]\nprefix_tokens = 64\nprefix_groups = 2\n')
    assert main(["sweep", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert ("workload.prefix_tokens must be <= every workload.context_tokens value (the prefix is part of the "
            "prompt; smallest 32), got 64") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before the results directory and any request


@pytest.mark.parametrize("name", ["compare.toml", "compare_long.toml"])
def test_the_packaged_comparison_loads_this_engine_beside_llama_server(name: str) -> None:
    config = load_config(DEMO.parent / name)
    engine, llama = config.servers
    assert (engine.name, engine.api, llama.name, llama.api) == ("engine", "engine.v1", "llama-server", "openai")
    assert engine.launch is not None and llama.launch is not None
    assert not {"--dtype", "--quantize", "--max-prefill-tokens"} & set(engine.launch.command)  # the engine's defaults
    assert {"{llama_server}", "{smollm2_gguf}", "--no-repack", "-t", "-np"} <= set(llama.launch.command)
    # every slot of llama-server holds a prompt and its output, and so does the engine's context
    slots = int(llama.launch.command[llama.launch.command.index("-np") + 1])
    slot_tokens = int(llama.launch.command[llama.launch.command.index("-c") + 1]) // slots
    engine_context = int(engine.launch.command[engine.launch.command.index("--max-context") + 1])
    longest = max(config.workload.context_tokens) + max(config.workload.max_new_tokens)
    assert longest <= slot_tokens and longest <= engine_context
    if name == "compare.toml":
        assert config.workload.concurrency == (1, 8, 32) and config.workload.requests_per_point >= 32
    else:
        assert config.workload.context_tokens == (1024,) and config.workload.concurrency == (1,)


# ---- datasets, tokenizer, endpoint, SLOs and the search ------------------------------------------------

def workload(**keys: Any) -> dict[str, Any]:
    return base(workload={"context_tokens": [8], "max_new_tokens": [4], "concurrency": [1], **keys})


def dataset_workload(**keys: Any) -> dict[str, Any]:
    return base(workload={"concurrency": [1, 4], **keys})


def test_workload_defaults_and_a_dataset_without_lengths(tmp_path: Path) -> None:
    w = parse_config(base()).workload
    assert (w.dataset, w.tokenizer, w.prompt_format, w.endpoint) == ("random", None, "text", "completions")
    assert (w.range_ratio, w.burstiness, w.duration_s, w.percentiles) == (0.0, 1.0, None, (50.0, 90.0, 95.0, 99.0))
    shared = parse_config(dataset_workload(dataset="sharegpt", tokenizer="smollm2", endpoint="chat")).workload
    assert (shared.context_tokens, shared.max_new_tokens, shared.dataset) == ((0,), (0,), "sharegpt")
    lines = tmp_path / "requests.jsonl"
    lines.write_text('{"prompt": "hi", "max_tokens": 4}\n')
    jsonl = parse_config(dataset_workload(dataset="jsonl:requests.jsonl", max_new_tokens=[8]),
                         base_dir=tmp_path).workload
    assert (jsonl.dataset, jsonl.max_new_tokens) == (f"jsonl:{lines}", (8,))
    relative = parse_config(workload(tokenizer="tok/tokenizer.json"), base_dir=tmp_path).workload
    assert relative.tokenizer == str(tmp_path / "tok" / "tokenizer.json")
    assert parse_config(workload(percentiles=[99, 50.5])).workload.percentiles == (50.5, 99.0)


@pytest.mark.parametrize(("raw", "message"), [
    (workload(dataset="wiki"), "workload.dataset must be 'random', 'sharegpt' or 'jsonl:PATH', got 'wiki'"),
    (workload(dataset="jsonl:"), "workload.dataset must be 'random', 'sharegpt' or 'jsonl:PATH', got 'jsonl:'"),
    (dataset_workload(dataset="jsonl:/nowhere/x.jsonl"),
     "workload.dataset 'jsonl:/nowhere/x.jsonl': the file '/nowhere/x.jsonl' does not exist"),
    (dataset_workload(dataset="sharegpt", context_tokens=[8]),
     "workload.context_tokens applies to dataset 'random' only (dataset 'sharegpt' gives its own prompts), got [8]"),
    (dataset_workload(dataset="sharegpt", prefix_tokens=4), "workload.prefix_tokens applies to dataset 'random' only"),
    (base(workload={"context_tokens": [8], "concurrency": [1]}), "workload.max_new_tokens is required, got nothing"),
    (dataset_workload(), "workload.context_tokens is required, got nothing"),
    (workload(prompt_format="ids"), "workload.prompt_format must be one of 'text', 'token_ids', got 'ids'"),
    (workload(endpoint="responses"), "workload.endpoint must be one of 'completions', 'chat', got 'responses'"),
    (workload(prompt_format="token_ids", endpoint="chat"),
     "workload.prompt_format 'token_ids' and workload.endpoint 'chat' are exclusive"),
    (dataset_workload(dataset="sharegpt", prompt_format="token_ids"),
     "workload.prompt_format 'token_ids' applies to dataset 'random' only (a dataset's prompts are text), got "
     "dataset 'sharegpt'"),
    (workload(tokenizer=""), "workload.tokenizer must be a non-empty string, got ''"),
    (workload(range_ratio=1.0), "workload.range_ratio must be in [0, 1) (lengths from c*(1-r) to c*(1+r)), got 1.0"),
    (workload(range_ratio=-0.1), "workload.range_ratio must be a finite number >= 0, got -0.1"),
    (workload(burstiness=0), "workload.burstiness must be > 0 (the gamma shape; 1 is Poisson), got 0.0"),
    (workload(duration_s=0), "workload.duration_s must be a finite number >= 0.001, got 0"),
    (workload(percentiles=[]), "workload.percentiles must be a non-empty list of numbers in (0, 100], got []"),
    (workload(percentiles=[0]), "workload.percentiles[0] must be in (0, 100], got 0"),
    (workload(percentiles=[101]), "workload.percentiles[0] must be in (0, 100], got 101"),
    (workload(percentiles=[50, 50]), "workload.percentiles must not repeat a value, got [50, 50]"),
    (workload(percentiles=["p99"]), "workload.percentiles[0] must be a number, got 'p99'"),
    (base(slo={}), "[slo] must set at least one of slo.ttft_ms, slo.tpot_ms, slo.e2el_ms, got an empty table"),
    (base(slo={"ttft": 5}), "unknown key slo.ttft (value 5)"),
    (base(slo={"ttft_ms": 0}), "slo.ttft_ms must be > 0 milliseconds, got 0"),
    (base(search={"over": "request_rate", "low": 1, "high": 2}), "[search] needs [slo]"),
    (base(slo={"ttft_ms": 5}, search={"over": "rate", "low": 1, "high": 2}),
     "search.over must be one of 'request_rate', 'concurrency', got 'rate'"),
    (base(slo={"ttft_ms": 5}, search={"over": "request_rate", "high": 2}), "search.low is required, got nothing"),
    (base(slo={"ttft_ms": 5}, search={"over": "request_rate", "low": 0, "high": 2}),
     "search.low must be > 0 requests/s, got 0"),
    (base(slo={"ttft_ms": 5}, search={"over": "concurrency", "low": 4, "high": 4}),
     "search.high must be > search.low 4, got 4"),
    (base(slo={"ttft_ms": 5}, search={"over": "concurrency", "low": 1.5, "high": 4}),
     "search.low must be an integer, got 1.5"),
    (base(slo={"ttft_ms": 5}, search={"over": "request_rate", "low": 1, "high": 4, "steps": 1}),
     "search.steps must be >= 2, got 1"),
    (base(slo={"ttft_ms": 5}, search={"over": "request_rate", "low": 1, "high": 4, "steps": 21}),
     "search.steps must be <= 20 (each is a whole point), got 21"),
    (base(slo={"ttft_ms": 5}, search={"over": "request_rate", "low": 1, "high": 4, "attainment": 0}),
     "search.attainment must be in (0, 1], got 0.0"),
])
def test_new_workload_keys_refused_with_the_key_and_value(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        parse_config(raw)


def test_slo_and_search_parse() -> None:
    config = parse_config(base(slo={"ttft_ms": 500, "e2el_ms": 2000.5},
                               search={"over": "concurrency", "low": 1, "high": 16, "steps": 5, "attainment": 0.95}))
    assert config.slo is not None and config.slo.as_dict() == {"ttft_ms": 500.0, "e2el_ms": 2000.5}
    assert config.search is not None
    assert (config.search.over, config.search.low, config.search.high, config.search.steps,
            config.search.attainment) == ("concurrency", 1, 16, 5, 0.95)
