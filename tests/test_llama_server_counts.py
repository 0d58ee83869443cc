"""Counted right against the real llama-server (llama.cpp, `make peers`): text prompts of exact
lengths by the model's own tokenizer, output tokens from the server's usage, and no retry counted
for a pooled keep-alive connection the server had closed.

The two reproducers of issue 26, as a new user met them:
- `-np 2 -c 1024`, 200-token prompts, 16 new tokens, concurrency 1, 4 requests: llama-server's
  events may carry more than one token, and the point recorded 56 output tokens where the server
  generated 64. Now: 64, from its usage.
- `-np 8 -c 8192`, concurrency 8, 24 requests: 7 were recorded as retries, each a pooled keep-alive
  connection llama-server had closed ("Can not write request body"). Now: none.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench_helpers import read_results, run_cli
from tests.llama_server import SERVER_FLAGS, require_llama_server


def _config(path: Path, *, slots: int, ctx: int, context: int, new: int, concurrency: int, requests: int) -> Path:
    command = ["{llama_server}", "-m", "{smollm2_gguf}", "-t", "2", "-np", str(slots), "-c", str(ctx),
               "--host", "127.0.0.1", "--port", "{port}", *SERVER_FLAGS]
    path.write_text(f"""api = "openai"

[workload]
tokenizer = "smollm2"
context_tokens = [{context}]
max_new_tokens = [{new}]
concurrency = [{concurrency}]
requests_per_point = {requests}
warmup_requests = 1
ignore_eos = true

[policy]
health_wait_s = 30.0
request_timeout_s = 120.0

[engine]
command = {json.dumps(command)}
startup_timeout_s = 60.0
drain_timeout_s = 10.0
""")
    return path


def test_output_tokens_are_the_servers_count_and_prompts_their_exact_length(tmp_path: Path) -> None:
    require_llama_server()
    config = _config(tmp_path / "sweep.toml", slots=2, ctx=1024, context=200, new=16, concurrency=1, requests=4)
    done = run_cli("sweep", str(config), "--out", str(tmp_path / "out"), "--detail", timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    [record] = read_results(tmp_path / "out")
    m = record["metrics"]
    assert record["status"] == "ok" and m["completed"] == 4, record
    assert m["total_output_tokens"] == 4 * 16, m  # the server's usage, not the events counted
    assert m["output_token_source"] == {"usage": 4}, m
    # llama.cpp's own tokenizer counts the text as the client's (the GGUF's) did: 200 each
    assert m["total_input_tokens"] == 4 * 200, m
    assert (record["prompt_format"], record["tokenizer"].split(" ")[0]) == ("text", "smollm2"), record
    detail = [json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]
    measured = [d for d in detail if not d["warmup"]]
    assert [d["output_tokens"] for d in measured] == [16] * 4
    # TPOT is per token of the server's count, ITL per streamed chunk
    for d in measured:
        chunks = [n for _, n in d["messages"] if n]
        assert sum(chunks) <= 16 and len(chunks) >= 2, d["messages"]


def test_closed_keep_alive_connections_are_no_retries(tmp_path: Path) -> None:
    require_llama_server()
    config = _config(tmp_path / "sweep.toml", slots=8, ctx=8192, context=128, new=16, concurrency=8, requests=24)
    done = run_cli("sweep", str(config), "--out", str(tmp_path / "out"), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    [record] = read_results(tmp_path / "out")
    assert record["status"] == "ok", record
    assert record["requests"]["completed"] == 24 and record["requests"]["retries"] == 0, record["requests"]
    assert record["metrics"]["total_output_tokens"] == 24 * 16, record["metrics"]
