"""The prefix cache over the wire: an engine process reports the cached prompt tokens in Usage,
GetLoad, its Prometheus metrics and its request_finished event, reports zero capacity with the
cache off, and refuses a size that is not whole blocks by naming the flag. The store itself and
the loop with it: tests/test_prefix_cache.py."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import torch

from engine.v1 import engine_pb2 as pb
from tests.engines import ROOT


def ids(seed: int, n: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(3, 250, (n,), generator=g).tolist())


def test_cached_tokens_are_reported_in_usage_get_load_metrics_and_the_span(start_engine):
    proc = start_engine("--model", "tiny", "--max-context", "256", "--prefix-cache-tokens", "512",
                        "--metrics-port", "0")
    prompt = list(ids(21, 60))
    usages = []
    for _ in range(2):
        last = list(proc.stub().Decode(pb.DecodeRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_new_tokens=3,
                                                        ignore_eos=True), timeout=30))[-1]
        usages.append((last.usage.prompt_tokens, last.usage.cached_prompt_tokens))
    assert usages == [(60, 0), (60, 48)]
    load = proc.load()
    assert (load.prefix_cache_used_tokens, load.prefix_cache_capacity_tokens) == (48, 512)
    body = urllib.request.urlopen(f"http://127.0.0.1:{proc.wait_events('metrics_started')[0]['port']}/metrics",
                                  timeout=5).read().decode()
    values = {line.split("{")[0]: float(line.rpartition(" ")[2]) for line in body.splitlines()
              if line and not line.startswith("#")}
    assert values["engine_prefix_cache_queries_total"] == 120.0
    assert values["engine_prefix_cache_hits_total"] == 48.0
    assert values["engine_prefix_cache_used_tokens"] == 48.0
    assert values["engine_prefix_cache_usage"] == 48 / 512
    finished = proc.wait_events("request_finished", count=2)
    assert [e["cached_prompt_tokens"] for e in finished] == [0, 48]


def test_an_engine_with_the_cache_off_reports_zero_capacity(start_engine):
    proc = start_engine("--model", "tiny", "--prefix-cache-tokens", "0")
    prompt = list(ids(22, 40))
    for _ in range(2):
        last = list(proc.stub().Decode(pb.DecodeRequest(prompt_token_ids=pb.TokenIds(ids=prompt), max_new_tokens=2),
                                       timeout=30))[-1]
        assert last.usage.cached_prompt_tokens == 0
    assert (proc.load().prefix_cache_used_tokens, proc.load().prefix_cache_capacity_tokens) == (0, 0)


def test_a_bad_prefix_cache_size_exits_2_naming_the_flag():
    out = subprocess.run([sys.executable, "-m", "engine_service", "--model", "tiny", "--prefix-cache-tokens", "100"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "prefix_cache_tokens must be 0 (off) or a multiple of the block size 16, got 100" in out.stderr
