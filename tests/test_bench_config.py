"""Sweep configuration: the demo loads; unknown keys, wrong types and impossible values are refused
with a message naming the key and the value, and the CLI exits 2."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest

from bench_client.__main__ import main, sweep_main
from bench_client.config import ConfigError, load_config, parse_config
from bench_client.engine_process import build_command, engine_configurations

DEMO = Path(__file__).resolve().parent.parent / "bench_client" / "demo.toml"


def base(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {"target": "127.0.0.1:1",
                           "workload": {"context_tokens": [8], "max_new_tokens": [4], "concurrency": [1]}}
    raw.update(overrides)
    return raw


def test_demo_config_loads_with_a_skipped_context() -> None:
    config = load_config(DEMO)
    assert config.engine is not None
    command = " ".join(config.engine.command)
    max_context = int(command.split("--max-context")[1].split()[0])
    assert max(config.workload.context_tokens) > max_context  # the demo shows a skip
    assert config.workload.ignore_eos


def test_defaults_and_inf_rate() -> None:
    config = parse_config(base(workload={"context_tokens": [8, 16], "max_new_tokens": [4], "concurrency": [1, 2],
                                         "request_rate": [2, "inf"]}))
    assert config.workload.request_rate == (2.0, math.inf)
    assert config.policy.max_attempts >= 1
    assert config.engine is None


@pytest.mark.parametrize(("raw", "message"), [
    (base(targte="x"), "unknown key targte (value 'x')"),
    (base(workload={"context_tokens": [8], "max_new_tokens": [4], "concurrency": [1], "concurency": [2]}),
     "unknown key workload.concurency (value [2])"),
    (base(workload={"context_tokens": [8], "max_new_tokens": [4], "concurrency": [0]}),
     "workload.concurrency[0] must be >= 1, got 0"),
    (base(workload={"context_tokens": "8", "max_new_tokens": [4], "concurrency": [1]}),
     "workload.context_tokens must be a non-empty list of integers, got '8'"),
    (base(workload={"context_tokens": [8], "max_new_tokens": [4], "concurrency": [1], "top_p": 2.0}),
     "workload.top_p must be in (0, 1], got 2.0"),
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
    (base(engine={"command": ["x", "{port}"]}), "target '127.0.0.1:1' and [engine] are exclusive"),
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
    launch = parse_config(raw).engine
    assert launch is not None
    configs = engine_configurations(launch)
    assert configs == [{"max_context": 128, "max_batch": 4}, {"max_context": 256, "max_batch": 4}]
    command = build_command(launch, configs[0], port=5555)
    assert command[1:] == ["-m", "engine_service", "--port", "5555", "--max-context", "128", "--max-batch", "4"]


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
