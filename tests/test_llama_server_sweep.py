"""A real sweep against the real llama-server (llama.cpp, `make peers`), through the CLI.

Two slots of 512 tokens (-np 2 -c 1024): the 32-token points fit, the 700-token point does
not and is skipped with llama-server's own 400 message. The sweep, with the llama-server it manages,
is killed with SIGKILL mid-sweep and resumed: every point is recorded once, and the managed
llama-server dies with the sweep (bench_client.parent_death), leaving none behind. (A sweep of a
running server's `target` is the same adapter: tests/test_bench_http_sweep.py; the server killed
and restarted mid-sweep: the http drill.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from drills.http_peer import llama_children, wait_gone
from tests.engines import ROOT
from tests.llama_server import SERVER_FLAGS, require_llama_server

SLOTS, CTX = 2, 1024  # 512 tokens per slot
CONTEXTS, NEW, CONCURRENCY = (32, 700), 8, (1, 2)
REQUESTS = 3
FITS = {c for c in CONTEXTS if c + NEW <= CTX // SLOTS}
POINTS = {(c, NEW, n) for c in CONTEXTS for n in CONCURRENCY}

WORKLOAD = f"""
[workload]
context_tokens = {list(CONTEXTS)}
max_new_tokens = [{NEW}]
concurrency = {list(CONCURRENCY)}
requests_per_point = {REQUESTS}
warmup_requests = 1
ignore_eos = true

[policy]
health_wait_s = 30.0
request_timeout_s = 60.0
"""


def _sweep(config: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "bench_client", "sweep", str(config), "--out", str(out), *extra]


def _run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]


def _key(record: dict) -> tuple[int, int, int]:
    return record["context_tokens"], record["max_new_tokens"], record["concurrency"]


def _check_points(records: list[dict], detail: str) -> None:
    assert sorted(_key(r) for r in records) == sorted(POINTS), detail  # each point exactly once
    for r in records:
        if r["context_tokens"] in FITS:
            assert r["status"] == "ok", (r, detail)
            assert r["requests"]["sent"] == REQUESTS and r["requests"]["completed"] == REQUESTS, r
            assert r["requests"]["failed"] == 0, r
            assert r["metrics"]["total_output_tokens"] == REQUESTS * NEW, r
        else:
            assert r["status"] == "skipped", (r, detail)
            assert r["reason"] == "CONTEXT_LENGTH_EXCEEDED", r
            assert "exceeds the available context size" in r["message"], r
            assert r["metrics"] is None, r


def _failure(proc: subprocess.CompletedProcess[str], *logs: Path) -> str:
    text = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-5000:]}"
    for log in logs:
        if log.is_file():
            text += f"\n--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}"
    return text


@pytest.mark.slow  # the http drill's quick form (tests/test_drills.py) kills the client mid-sweep and resumes the same way
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; parent_death is Linux's prctl")
def test_kill_9_mid_sweep_then_resume_records_every_point_once(tmp_path: Path) -> None:
    require_llama_server()
    command = ["{llama_server}", "-m", "{smollm2_gguf}", "-t", "2", "-np", str(SLOTS), "-c", str(CTX),
               "--host", "127.0.0.1", "--port", "{port}", *SERVER_FLAGS]
    config = tmp_path / "sweep.toml"
    config.write_text('api = "openai"\n' + WORKLOAD + f"""
[engine]
command = {json.dumps(command)}
startup_timeout_s = 60.0
drain_timeout_s = 10.0
""")
    out = tmp_path / "out"
    results = out / "results.jsonl"
    sweep = subprocess.Popen(_sweep(config, out), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    servers: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while not (results.is_file() and results.read_text().count("\n") >= 1):
            assert sweep.poll() is None, f"the sweep exited with {sweep.returncode} before recording a point"
            assert time.monotonic() < deadline, "no point recorded within 90 s"
            servers = llama_children(sweep.pid) or servers
            time.sleep(0.05)
        servers = llama_children(sweep.pid) or servers
        os.kill(sweep.pid, signal.SIGKILL)
        sweep.wait(10)
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait(10)
    assert servers, "the sweep's managed llama-server was never seen"
    assert wait_gone(servers) == [], f"llama-server {servers} outlived the killed sweep"
    before = _records(out)
    assert 1 <= len(before) < len(POINTS), before

    resumed = _run(_sweep(config, out, "--resume"))
    assert resumed.returncode == 0, _failure(resumed, *sorted(out.glob("engine-*.log")))
    records = _records(out)
    _check_points(records, _failure(resumed))
    assert [_key(r) for r in records[:len(before)]] == [_key(r) for r in before]  # kept, not rerun
    assert len({r["run_id"] for r in records}) == 2, records
    assert {r["api"] for r in records} == {"openai"} and {r["server_info"]["dtype"] for r in records} == {"Q4_1"}
    refused = [r for r in records if r["status"] == "skipped" and not r["skipped_without_sending"]]
    assert refused and refused[0]["skip_code"] == "HTTP_400", records  # refused by the server itself
    engines = [json.loads(line) for line in (out / "engines.jsonl").read_text().splitlines() if line.strip()]
    assert engines, "the resumed sweep recorded no managed engine run"
    assert all(e["how"] == "drained" for e in engines), engines
    assert wait_gone([e["pid"] for e in engines] + servers, timeout=5) == [], engines  # none left behind
