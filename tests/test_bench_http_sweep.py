"""Sweeps over OpenAI-compatible HTTP servers, end to end through the sweep runner: small fake
servers (aiohttp.web on 127.0.0.1, real sockets and status codes) shaped as vLLM and llama-server
answer, beside a real engine over engine.v1 in the same sweep. What the one policy table does with
each HTTP answer shows in the records and the table exactly as it does for gRPC."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from rich.console import Console

from bench_client.report import build_table
from bench_client.sweep import SweepEnd
from tests.bench_helpers import point_counts, read_results, run_in_process
from tests.engines import EngineProcess

pytestmark = pytest.mark.timeout(60)

VOCAB = 49152


class FakeServer:
    """An OpenAI-compatible completion server: `limit` tokens of context (vLLM's 400 beyond it),
    `slot` tokens after which it stops an answer early without an error (llama-server's full slot),
    optional 429s before answering, a 401 for every call, or an error frame after `fail_after` tokens."""

    def __init__(self, *, limit: int = 10_000, slot: int = 10_000, busy: int = 0, deny: bool = False,
                 fail_after: int | None = None, reject_top_k: bool = False) -> None:
        self.limit, self.slot, self.busy, self.deny = limit, slot, busy, deny
        self.fail_after, self.reject_top_k = fail_after, reject_top_k
        self.prompts: list[tuple[int, ...]] = []
        self.url = ""

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "max_model_len": self.limit}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.deny:
            return web.json_response({"error": {"message": "Invalid API key", "type": "authentication_error",
                                                "code": 401}}, status=401)
        if self.busy > 0:
            self.busy -= 1
            return web.json_response({"error": {"message": "server busy", "code": 429}}, status=429,
                                     headers={"Retry-After": "0"})
        prompt, wanted = tuple(body["prompt"]), int(body["max_tokens"])
        if self.reject_top_k and "top_k" in body:
            return web.json_response({"error": {"message": "top_k must be -1 or at least 1, got 0",
                                                "type": "BadRequestError", "param": "top_k", "code": 400}}, status=400)
        if len(prompt) + wanted > self.limit:
            return web.json_response({"error": {
                "message": f"This model's maximum context length is {self.limit} tokens. However, you requested "
                           f"{len(prompt) + wanted} tokens ({len(prompt)} in the messages, {wanted} in the "
                           "completion). Please reduce the length of the messages or completion.",
                "type": "BadRequestError", "param": None, "code": 400}}, status=400)
        self.prompts.append(prompt)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        produced = min(wanted, max(0, self.slot - len(prompt)))
        for i in range(produced):
            if self.fail_after is not None and i == self.fail_after:
                await response.write(b'data: {"error": {"code": 500, "message": "slot died", "type": "server_error"}}'
                                     b"\n\n")
                await response.write_eof()
                return response
            event = {"choices": [{"text": f" t{i}", "index": 0, "finish_reason": None}]}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        final = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                 "usage": {"prompt_tokens": len(prompt), "completion_tokens": produced,
                           "total_tokens": len(prompt) + produced},
                 "timings": {"prompt_n": len(prompt), "prompt_ms": 1.5, "predicted_n": produced, "cache_n": 0}}
        await response.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response


Start = Callable[[FakeServer], Awaitable[str]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    runners: list[web.AppRunner] = []

    async def run(server: FakeServer) -> str:
        app = web.Application()
        app.router.add_get("/health", server.health)
        app.router.add_get("/v1/models", server.models)
        app.router.add_post("/v1/completions", server.completions)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        server.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        return server.url

    yield run
    for runner in runners:
        await runner.cleanup()


def workload(**overrides: Any) -> dict[str, Any]:
    return {"context_tokens": [16, 48], "max_new_tokens": [8], "concurrency": [1, 2], "requests_per_point": 3,
            "warmup_requests": 1, "prompt_format": "token_ids", **overrides}


def table_text(records: list[dict[str, Any]]) -> str:
    console = Console(width=400, record=True)
    console.print(build_table(records))
    return console.export_text()


async def test_side_by_side_one_results_file_the_same_prompts_and_the_server_first(start: Start,
                                                                                  tmp_path: Path) -> None:
    left, right = FakeServer(), FakeServer()
    with EngineProcess("--model", "tiny", "--max-context", "256") as engine:
        raw = {"servers": {
            "vllm-a": {"api": "openai", "target": await start(left), "vocab_size": VOCAB},
            "vllm-b": {"api": "openai", "target": await start(right), "vocab_size": VOCAB},
            "engine": {"target": engine.address},
        }, "workload": workload(), "policy": {"health_wait_s": 5.0, "request_timeout_s": 20.0}}
        result, _ = await run_in_process(raw, tmp_path / "out")
    assert result.end is SweepEnd.COMPLETED, result.message
    records = read_results(tmp_path / "out")
    assert set(point_counts(records).values()) == {1} and len(records) == 3 * 4
    assert {(r["server"], r["api"]) for r in records} == {("vllm-a", "openai"), ("vllm-b", "openai"),
                                                           ("engine", "engine.v1")}
    assert all(r["status"] == "ok" and r["requests"]["completed"] == 3 for r in records), records
    assert all(r["metrics"]["total_output_tokens"] == 3 * 8 for r in records)
    # the same prompts, in the same order, at every point, for each server: compared on equal terms
    assert left.prompts == right.prompts and len(left.prompts) == 4 * (1 + 3)
    assert len(set(left.prompts)) == len(left.prompts)  # and every request of every point its own
    # the server's own view is kept beside the client's
    http = [r for r in records if r["api"] == "openai"]
    assert all(r["metrics"]["server_timings_mean"]["predicted_n"] == 8.0 for r in http)
    assert all(r["metrics"]["usage_mismatches"] == 0 for r in http)
    assert {r["server_info"]["api"] for r in http} == {"openai"}
    assert all(r["server_info"]["reported"]["models"]["data"][0]["id"] == "fake" for r in http)
    rows = [line.split("│")[1].strip() for line in table_text(records).splitlines() if line.startswith("│")]
    assert sorted(set(rows)) == ["engine", "vllm-a", "vllm-b"] and len(rows) == 12  # the server, first


async def test_context_refusals_skip_and_other_refusals_skip_apart(start: Start, tmp_path: Path) -> None:
    """vLLM's 400 for a prompt beyond its context skips the point as CONTEXT_LENGTH_EXCEEDED with the
    server's own message, and larger contexts are skipped without sending; a 400 about a parameter
    skips as BAD_REQUEST, never as a context skip; the table shows the two apart."""
    fits = FakeServer(limit=40)
    picky = FakeServer(reject_top_k=True)
    raw = {"servers": {"small": {"api": "openai", "target": await start(fits), "vocab_size": VOCAB},
                       "picky": {"api": "openai", "target": await start(picky), "vocab_size": VOCAB}},
           "workload": workload(context_tokens=[16, 48, 64], top_k=5), "policy": {"health_wait_s": 5.0}}
    result, _ = await run_in_process(raw, tmp_path / "out")
    assert result.end is SweepEnd.COMPLETED, result.message
    records = read_results(tmp_path / "out")
    small = {(r["context_tokens"], r["concurrency"]): r for r in records if r["server"] == "small"}
    assert [small[(16, x)]["status"] for x in (1, 2)] == ["ok", "ok"]
    refused = small[(48, 1)]
    assert (refused["status"], refused["reason"], refused["skip_code"]) == ("skipped", "CONTEXT_LENGTH_EXCEEDED",
                                                                             "HTTP_400")
    assert refused["message"].startswith("This model's maximum context length is 40 tokens.")
    assert refused["reason_metadata"]["maxContextTokens"] == "40" and not refused["skipped_without_sending"]
    assert all(small[(c, x)]["skipped_without_sending"] for c, x in ((48, 2), (64, 1), (64, 2)))
    picky_records = [r for r in records if r["server"] == "picky"]
    assert {(r["status"], r["reason"]) for r in picky_records} == {("skipped", "BAD_REQUEST")}
    assert all("top_k must be" in r["message"] for r in picky_records)
    text = table_text(records)
    assert "CONTEXT_LENGTH_EXCEEDED" in text and "BAD_REQUEST" in text and "[HTTP_400]" in text


async def test_truncated_answers_are_not_successes_and_the_point_says_so(start: Start, tmp_path: Path) -> None:
    """A llama-server slot full before max_tokens: finish_reason length early, no error."""
    server = FakeServer(slot=52)
    raw = {"api": "openai", "target": await start(server), "vocab_size": VOCAB,
           "workload": workload(context_tokens=[16, 48], concurrency=[1]), "policy": {"max_error_rate": 0.5}}
    result, _ = await run_in_process(raw, tmp_path / "out", detail=True)
    assert result.end is SweepEnd.COMPLETED, result.message
    by_context = {r["context_tokens"]: r for r in read_results(tmp_path / "out")}
    assert by_context[16]["status"] == "ok" and by_context[16]["requests"]["truncated"] == 0
    cut = by_context[48]
    assert cut["status"] == "failed" and cut["requests"]["truncated"] == 3 and cut["requests"]["completed"] == 0
    assert cut["requests"]["failed_by_code"] == {"TRUNCATED": 3} and "3 truncated by the server" in cut["message"]
    assert cut["metrics"]["completed"] == 0
    detail = [json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]
    assert {d["status"] for d in detail if d["context_tokens"] == 48} == {"truncated"}
    assert {d["output_tokens"] for d in detail if d["context_tokens"] == 48} == {4}
    assert "3 truncated" in table_text(read_results(tmp_path / "out"))


async def test_429_backs_off_then_succeeds_and_an_error_frame_fails_the_request(start: Start,
                                                                               tmp_path: Path) -> None:
    busy, broken = FakeServer(busy=2), FakeServer(fail_after=3)
    raw = {"servers": {"busy": {"api": "openai", "target": await start(busy), "vocab_size": VOCAB},
                       "broken": {"api": "openai", "target": await start(broken), "vocab_size": VOCAB}},
           "workload": workload(context_tokens=[16], concurrency=[1], warmup_requests=0),
           "policy": {"max_error_rate": 1.0, "backoff_initial_s": 0.01, "backoff_max_s": 0.05}}
    result, _ = await run_in_process(raw, tmp_path / "out")
    assert result.end is SweepEnd.COMPLETED, result.message
    records = {r["server"]: r for r in read_results(tmp_path / "out")}
    assert records["busy"]["status"] == "ok" and records["busy"]["requests"]["retries"] == 2
    failed = records["broken"]["requests"]
    assert (failed["completed"], failed["failed"], failed["failed_by_code"]) == (0, 3, {"HTTP_500": 3})
    assert failed["failed_by_reason"] == {"STREAM_ERROR": 3}


async def test_401_stops_the_sweep_resumably(start: Start, tmp_path: Path) -> None:
    raw = {"api": "openai", "target": await start(FakeServer(deny=True)), "vocab_size": VOCAB,
           "workload": workload()}
    result, _ = await run_in_process(raw, tmp_path / "out")
    assert result.end is SweepEnd.STOPPED and "HTTP_401" in result.message and "Invalid API key" in result.message
    assert read_results(tmp_path / "out") == [] if (tmp_path / "out" / "results.jsonl").exists() else True


async def test_a_server_that_cannot_say_what_it_is_stops_the_sweep_naming_the_answer(start: Start,
                                                                                      tmp_path: Path) -> None:
    class Broken(FakeServer):
        async def models(self, request: web.Request) -> web.Response:
            return web.json_response({"error": {"message": "model registry down", "code": 500}}, status=500)

    raw = {"api": "openai", "target": await start(Broken()), "vocab_size": VOCAB, "workload": workload()}
    result, _ = await run_in_process(raw, tmp_path / "out")
    assert result.end is SweepEnd.STOPPED
    assert "about itself failed: HTTP_500" in result.message and "model registry down" in result.message
