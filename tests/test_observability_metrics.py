"""Metrics: the engine's Prometheus endpoint (`--metrics-port`), scraped directly and by a real
Prometheus server (the Debian package `prometheus`) started on loopback by the test."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from bench_client.server_process import free_port, stop_blocking
from tests.contract import decode, expect_error
from tests.engines import ROOT, EngineProcess

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
METRIC_NAMES = (
    "engine_requests_total", "engine_prompt_tokens_total", "engine_generation_tokens_total",
    "engine_queue_depth", "engine_batch_size", "engine_kv_cache_used_tokens", "engine_kv_cache_usage",
    "gen_ai_server_time_to_first_token_seconds_bucket", "gen_ai_server_time_per_output_token_seconds_bucket",
    "gen_ai_server_request_duration_seconds_bucket",
)


@pytest.fixture(scope="module")
def metered():
    """An engine with metrics on a free port, after 4 successful requests and 1 rejected one."""
    with EngineProcess("--model", "tiny", "--max-context", "256", "--max-new-tokens", "200",
                       "--metrics-port", "0") as proc:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: decode(proc.stub(), prompt_text=f"prompt {i}", max_new_tokens=6, ignore_eos=True),
                          range(4)))
        got = expect_error(decode, proc.stub(), prompt_text="x", max_new_tokens=0)
        assert got["code"] == grpc.StatusCode.INVALID_ARGUMENT
        proc.metrics_port = proc.events_named("metrics_started")[0]["port"]
        yield proc


def scrape(port: int) -> dict[str, float]:
    """`name{labels}` -> value from the text exposition format."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def series(samples: dict[str, float], name: str, **labels: str) -> list[float]:
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return [v for key, v in samples.items() if key.split("{")[0] == name and all(w in key for w in wanted)]


def test_the_endpoint_serves_every_metric_with_the_requests_counted(metered):
    samples = scrape(metered.metrics_port)
    names = {key.split("{")[0] for key in samples}
    assert set(METRIC_NAMES) <= names, sorted(names)
    assert series(samples, "engine_requests_total", status="OK", reason="") == [4.0]
    assert series(samples, "engine_requests_total", status="INVALID_ARGUMENT", reason="INVALID_FIELD") == [1.0]
    assert series(samples, "engine_generation_tokens_total") == [24.0]
    assert series(samples, "engine_prompt_tokens_total") == [4.0 * (len(b"prompt 0") + 1)]  # bytes + BOS
    assert series(samples, "gen_ai_server_time_to_first_token_seconds_count") == [4.0]
    assert series(samples, "gen_ai_server_time_per_output_token_seconds_count") == [4.0]
    assert sum(series(samples, "gen_ai_server_request_duration_seconds_count")) == 5.0
    assert series(samples, "engine_queue_depth") == [0.0] and series(samples, "engine_batch_size") == [0.0]
    assert series(samples, "engine_kv_cache_usage") == [0.0]


def test_an_unauthenticated_decode_is_counted(start_engine):
    proc = start_engine("--model", "tiny", "--metrics-port", "0", env={"ENGINE_AUTH_TOKEN": "t0ken"})
    got = expect_error(decode, proc.stub(), prompt_text="x", max_new_tokens=2)
    assert got["code"] == grpc.StatusCode.UNAUTHENTICATED
    samples = scrape(proc.wait_events("metrics_started")[0]["port"])
    assert series(samples, "engine_requests_total", status="UNAUTHENTICATED", reason="UNAUTHENTICATED") == [1.0]
    assert series(samples, "engine_prompt_tokens_total") in ([], [0.0])  # nothing was read from the request


def test_metrics_are_off_by_default(start_engine):
    proc = start_engine("--model", "tiny")
    assert not proc.events_named("metrics_started")


def test_an_unbindable_metrics_port_is_a_start_up_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "engine_service", "--port", "0", "--compile-decode", "off",
                               "--metrics-port", str(port)],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    failed = [json.loads(line) for line in proc.stderr.splitlines() if '"engine_start_failed"' in line]
    assert failed and f"127.0.0.1:{port}" in failed[0]["error"]


def prom_query(port: int, query: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    reply = json.load(urllib.request.urlopen(url, timeout=5))
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def test_a_real_prometheus_scrapes_the_engine(metered, tmp_path):
    if not shutil.which(PROMETHEUS):
        pytest.skip(f"{PROMETHEUS} is not installed (Debian package `prometheus`; .ci/run installs it)")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: engine\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{metered.metrics_port}']\n")
    port = free_port()
    server = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        results: dict[str, list[dict]] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(results) < 3:
            time.sleep(0.5)
            if server.poll() is not None:
                pytest.fail(f"prometheus exited {server.returncode}: {server.stderr.read()}")  # type: ignore[union-attr]
            try:
                for query in ('up{job="engine"} == 1', 'engine_requests_total{status="OK"}',
                              "gen_ai_server_time_to_first_token_seconds_count"):
                    if query not in results and (found := prom_query(port, query)):
                        results[query] = found
            except OSError:
                continue  # not listening yet
        assert len(results) == 3, f"series Prometheus has after 60 s: {results}"
        assert float(results['engine_requests_total{status="OK"}'][0]["value"][1]) == 4.0
        assert float(results["gen_ai_server_time_to_first_token_seconds_count"][0]["value"][1]) == 4.0
        for name in METRIC_NAMES:
            assert prom_query(port, name), f"Prometheus has no series {name}"
        rejected = prom_query(port, 'engine_requests_total{status="INVALID_ARGUMENT",reason="INVALID_FIELD"}')
        assert float(rejected[0]["value"][1]) == 1.0
    finally:
        stop_blocking(server, 20)
