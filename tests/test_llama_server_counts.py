"""Counted right against the real llama-server (llama.cpp, `make peers`): text prompts of exact
lengths by the model's own tokenizer, output tokens from the server's usage, and no retry counted
for a pooled keep-alive connection the server had closed.

The two reproducers of issue 26, as a new user met them, in one point of one llama-server
(16 new tokens, concurrency 8; 100-token prompts where the user's were 200: the same exact-length
text through both tokenizers, at half the prefill):
- llama-server's events may carry more than one token, and a point recorded 56 output tokens where
  the server generated 64. Now every count is the server's usage, whatever this run's events
  carried (a fake server that always packs tokens: tests/test_bench_workload.py).
- 7 of 24 requests at concurrency 8 were recorded as retries, each a pooled keep-alive connection
  llama-server had closed ("Can not write request body"). Now: none (such a request is sent again
  on a fresh connection; its unit tests: tests/test_openai_http.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench_helpers import read_results, run_cli
from tests.llama_server import SERVER_FLAGS, require_llama_server


def _config(path: Path, *, slots: int, ctx: int, context: int, new: int, concurrency: str, requests: int) -> Path:
    command = ["{llama_server}", "-m", "{smollm2_gguf}", "-t", "2", "-np", str(slots), "-c", str(ctx),
               "--host", "127.0.0.1", "--port", "{port}", *SERVER_FLAGS]
    path.write_text(f"""api = "openai"

[workload]
tokenizer = "smollm2"
context_tokens = [{context}]
max_new_tokens = [{new}]
concurrency = {concurrency}
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


def test_counts_from_usage_exact_text_prompts_and_no_retry_for_closed_connections(tmp_path: Path) -> None:
    require_llama_server()
    config = _config(tmp_path / "sweep.toml", slots=8, ctx=8192, context=100, new=16, concurrency="[8]",
                     requests=8)
    done = run_cli("sweep", str(config), "--out", str(tmp_path / "out"), "--detail", timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    records = {r["concurrency"]: r for r in read_results(tmp_path / "out")}
    assert sorted(records) == [8]
    for record in records.values():
        m = record["metrics"]
        assert record["status"] == "ok" and m["completed"] == 8, record
        assert m["total_output_tokens"] == 8 * 16, m  # the server's usage, whatever the events carried
        assert m["output_token_source"] == {"usage": 8}, m
        # llama.cpp's own tokenizer counts the text as the client's (the GGUF's, through tokenizers) did
        assert m["total_input_tokens"] == 8 * 100, m
        assert (record["prompt_format"], record["tokenizer"].split(" ")[0]) == ("text", "smollm2"), record
        # a dead pooled connection is sent again on a fresh one: never a retry
        assert record["requests"]["retries"] == 0, record["requests"]
    detail = [json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]
    measured = [d for d in detail if not d["warmup"]]
    assert len(measured) == 8 and {d["output_tokens"] for d in measured} == {16}
    assert all(d["output_token_source"] == "usage" and d["streamed_tokens"] <= 16 for d in measured), measured
