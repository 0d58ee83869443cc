"""Helpers for the bench_client tests: configs, running the CLI as a subprocess, reading results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from bench_client.config import SweepConfig, parse_config
from bench_client.progress import SweepProgress
from bench_client.results import PointKey, ResultsDir
from bench_client.sweep import SweepResult, SweepRunner

ROOT = Path(__file__).resolve().parent.parent


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def to_toml(raw: dict[str, Any]) -> str:
    """Enough TOML for sweep configs: top-level scalars, then tables (nested one level)."""
    lines = [f"{k} = {toml_value(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for table, body in raw.items():
        if isinstance(body, dict):
            lines.append(f"[{table}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in body.items() if not isinstance(v, dict)]
            for sub, sub_body in body.items():
                if isinstance(sub_body, dict):
                    lines.append(f"[{table}.{sub}]")
                    lines += [f"{k} = {toml_value(v)}" for k, v in sub_body.items()]
    return "\n".join(lines) + "\n"


def sweep_raw(target: str | None = None, engine: dict[str, Any] | None = None, **workload: Any) -> dict[str, Any]:
    policy = workload.pop("policy", {})
    raw: dict[str, Any] = {}
    if target is not None:
        raw["target"] = target
    # token ids by default: these sweeps test what the client does with answers; text prompts and
    # datasets have their own tests (test_bench_workload.py)
    raw["workload"] = {"context_tokens": [16], "max_new_tokens": [8], "concurrency": [1], "requests_per_point": 4,
                       "warmup_requests": 0, "prompt_format": "token_ids", **workload}
    raw["policy"] = {"health_wait_s": 5.0, "request_timeout_s": 30.0, **policy}
    if engine is not None:
        raw["engine"] = engine
    return raw


def write_config(path: Path, raw: dict[str, Any]) -> Path:
    path.write_text(to_toml(raw))
    return path


def managed_engine(*flags: str, **table: Any) -> dict[str, Any]:
    """An [engine] table starting the tiny preset with one torch thread."""
    return {"command": ["{python}", "-m", "engine_service", "--model", "tiny", "--host", "127.0.0.1",
                        "--port", "{port}", "--threads", "1", *flags],
            "startup_timeout_s": 60.0, "drain_timeout_s": 15.0, **table}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "bench_client", *args]


def run_cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cli(*args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def events(stderr: str) -> list[dict[str, Any]]:
    out = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line of something else that starts with a brace
    return out


def read_results(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def point_counts(records: list[dict[str, Any]]) -> Counter[PointKey]:
    return Counter(PointKey.of_record(r) for r in records)


async def run_in_process(raw: dict[str, Any], out: Path, *, resume: bool = False,
                         detail: bool = False) -> tuple[SweepResult, ResultsDir]:
    config: SweepConfig = parse_config(raw)
    results = ResultsDir.open(out, resume=resume, detail=detail)
    try:
        with SweepProgress(enabled=False) as progress:
            result = await SweepRunner(config, results, progress).run()
    finally:
        results.close()
    return result, results
