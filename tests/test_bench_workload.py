"""Real traffic through whole sweeps: text prompts sized by a tokenizer (the sweep's, or the server's
own tokenize endpoint), datasets (JSONL, ShareGPT), the chat endpoint, counts from the server's usage
or the tokenizer, SLOs and goodput, the SLO search (resumable), time-bounded points, TGI.

The servers are real aiohttp servers on 127.0.0.1 shaped like llama-server (its /tokenize, its
events that may carry several tokens) and a real TGI-shaped fake (tests/tgi_fake.py); the tokenizer
is SmolLM2's own, the engine's packaged GGUF.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bench_client.config import SearchConfig, parse_config
from bench_client.point import arrival_offsets
from bench_client.progress import SweepProgress
from bench_client.results import ResultsDir
from bench_client.slo_search import Probe, next_probe, result_of
from bench_client.sweep import SweepEnd, SweepRunner
from bench_client.tokenizer import LocalTokenizer, load_tokenizer
from tests.bench_helpers import run_in_process
from tests.tgi_fake import tgi_fake


@pytest.fixture(scope="module")
def smollm2() -> LocalTokenizer:
    return load_tokenizer("smollm2", base_dir=Path.cwd())


@dataclass
class Peer:
    """A llama-server-shaped OpenAI server: /tokenize with SmolLM2's tokenizer (optional), no
    vocabulary in /v1/models, answers of `max_tokens` words streamed `per_event` tokens an event,
    usage at the end (optional), the first token `ttft_per_request_s` x the requests in flight
    (itself included) after the request arrived: a server that slows down with load."""

    tokenizer: LocalTokenizer
    tokenize: bool = True
    tokenize_status: int = 200  # another status: /tokenize answers it with an error body
    usage: bool = True
    per_event: int = 1
    ttft_per_request_s: float = 0.0
    token_delay_s: float = 0.0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        if self.tokenize:
            app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "peer", "object": "model", "max_model_len": 4096}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        if self.tokenize_status != 200:
            return web.json_response({"error": {"code": self.tokenize_status, "message": "tokenizer broke",
                                                "type": "server_error"}}, status=self.tokenize_status)
        body = await request.json()
        return web.json_response({"tokens": [0] * self.tokenizer.count(body["content"])})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        chat = request.path.endswith("/chat/completions")
        prompt = (" ".join(m["content"] for m in body["messages"]) if chat else body["prompt"])
        prompt_tokens = self.tokenizer.count(prompt)
        self.in_flight += 1
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            if self.ttft_per_request_s:
                await asyncio.sleep(self.ttft_per_request_s * self.in_flight)
            wanted = body["max_tokens"]
            sent = 0
            while sent < wanted:
                k = min(self.per_event, wanted - sent)
                text = " the" * k  # one SmolLM2 token each
                choice = {"delta": {"content": text}} if chat else {"text": text}
                await response.write(_event({"choices": [{"index": 0, **choice, "finish_reason": None}]}))
                sent += k
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
            await response.write(_event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}))
            if self.usage:
                await response.write(_event({"choices": [], "usage": {
                    "prompt_tokens": prompt_tokens, "completion_tokens": wanted,
                    "total_tokens": prompt_tokens + wanted}}))
            await response.write(b"data: [DONE]\n\n")
            return response
        finally:
            self.in_flight -= 1


def _event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


Start = Callable[[Peer], Awaitable[str]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    runners: list[web.AppRunner] = []

    async def go(peer: Peer) -> str:
        runner = web.AppRunner(peer.app(), shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield go
    for runner in runners:
        await runner.cleanup()


def sweep(target: str, **workload: Any) -> dict[str, Any]:
    extra = {k: workload.pop(k) for k in ("slo", "search") if k in workload}
    return {"api": "openai", "target": target, **extra,
            "workload": {"concurrency": [1], "requests_per_point": 3, "warmup_requests": 0, **workload},
            "policy": {"health_wait_s": 5.0, "request_timeout_s": 20.0}}


async def test_text_prompts_sized_by_the_servers_tokenize_endpoint_without_a_vocabulary(
        start: Start, smollm2: LocalTokenizer, tmp_path: Path) -> None:
    peer = Peer(smollm2, per_event=3)
    raw = sweep(await start(peer), context_tokens=[24, 40], max_new_tokens=[8], concurrency=[1, 2])
    result, results = await run_in_process(raw, tmp_path / "out")
    assert result.end is SweepEnd.COMPLETED, result.message
    prompts = [b["prompt"] for b in peer.bodies]
    assert all(isinstance(p, str) for p in prompts) and len(set(prompts)) == len(prompts) == 4 * 3
    assert sorted({smollm2.count(p) for p in prompts}) == [24, 40]  # exact lengths, by the server's count
    for r in results.records:
        assert r["status"] == "ok" and r["prompt_format"] == "text", r
        assert r["tokenizer"] == f"the tokenize endpoint of {raw['target']}"
        m = r["metrics"]
        # 8 tokens in events of 3: the server's usage counts them, the events do not
        assert m["total_output_tokens"] == 3 * 8 and m["output_token_source"] == {"usage": 3}, m
        assert m["usage_mismatches"] == 3  # the diagnostic: the events said 3 tokens (one each)
        assert m["total_input_tokens"] == 3 * r["context_tokens"], m


async def test_the_same_text_for_every_server_and_counts_by_the_tokenizer_without_usage(
        start: Start, smollm2: LocalTokenizer, tmp_path: Path) -> None:
    with_usage = Peer(smollm2, tokenize=False, per_event=2)
    silent = Peer(smollm2, tokenize=False, usage=False, per_event=2)
    raw = {"servers": {"a": {"api": "openai", "target": await start(with_usage)},
                       "b": {"api": "openai", "target": await start(silent)}},
           "workload": {"tokenizer": "smollm2", "context_tokens": [32], "max_new_tokens": [6], "concurrency": [1],
                        "requests_per_point": 3, "warmup_requests": 1}}
    result, results = await run_in_process(raw, tmp_path / "out")
    assert result.end is SweepEnd.COMPLETED, result.message
    assert [b["prompt"] for b in with_usage.bodies] == [b["prompt"] for b in silent.bodies]
    by_server = {r["server"]: r["metrics"] for r in results.records}
    assert by_server["a"]["output_token_source"] == {"usage": 3}
    # no usage: the text (" the" x 6) counted by the sweep's tokenizer, not the 3 events
    assert by_server["b"]["output_token_source"] == {"tokenizer": 3}
    assert by_server["a"]["total_output_tokens"] == by_server["b"]["total_output_tokens"] == 18
    assert {r["tokenizer"].split(" ")[0] for r in results.records} == {"smollm2"}


async def test_no_tokenizer_and_no_tokenize_endpoint_stops_with_what_to_do(
        start: Start, smollm2: LocalTokenizer, tmp_path: Path) -> None:
    target = await start(Peer(smollm2, tokenize=False))
    result, results = await run_in_process(sweep(target, context_tokens=[16], max_new_tokens=[4]), tmp_path / "o")
    assert result.end is SweepEnd.STOPPED and results.records == []
    assert f"the prompts need a tokenizer and {target} has no tokenize endpoint" in result.message
    assert "name one with workload.tokenizer" in result.message
    ids, _ = await run_in_process(sweep(target, context_tokens=[16], max_new_tokens=[4], prompt_format="token_ids"),
                                  tmp_path / "ids")
    assert ids.end is SweepEnd.STOPPED
    assert "workload.prompt_format 'token_ids' needs the vocabulary size" in ids.message


async def test_a_failing_tokenize_endpoint_stops_the_sweep_by_the_policy(
        start: Start, smollm2: LocalTokenizer, tmp_path: Path) -> None:
    target = await start(Peer(smollm2, tokenize_status=500))
    result, results = await run_in_process(sweep(target, context_tokens=[16], max_new_tokens=[4]), tmp_path / "o")
    assert result.end is SweepEnd.STOPPED and results.records == []
    assert result.message.startswith(f"sizing the prompts of point c16-n4-x1-rinf with {target}'s tokenize "
                                     "endpoint failed: "), result.message
    assert "tokenizer broke" in result.message


async def test_a_jsonl_dataset_on_the_chat_endpoint(start: Start, smollm2: LocalTokenizer, tmp_path: Path) -> None:
    lines = tmp_path / "requests.jsonl"
    lines.write_text("\n".join(json.dumps(line) for line in [
        {"prompt": "Tell me about the sea.", "max_tokens": 5},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]},
        {"prompt": "Count to three.", "max_tokens": 3},
    ]) + "\n")
    peer = Peer(smollm2)
    raw = sweep(await start(peer), dataset=f"jsonl:{lines}", tokenizer="smollm2", endpoint="chat",
                max_new_tokens=[7], requests_per_point=3)
    result, results = await run_in_process(raw, tmp_path / "out")
    assert result.end is SweepEnd.COMPLETED, result.message
    assert all("messages" in b and "prompt" not in b for b in peer.bodies)
    sent = sorted(json.dumps(b["messages"]) for b in peer.bodies)
    assert sent == sorted(json.dumps(m) for m in [
        [{"role": "user", "content": "Tell me about the sea."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        [{"role": "user", "content": "Count to three."}]])
    assert {b["max_tokens"] for b in peer.bodies} == {7}  # the grid's max_new_tokens overrides the lines'
    [record] = results.records
    assert (record["dataset"], record["endpoint"], record["context_tokens"]) == (f"jsonl:{lines}", "chat", 0)
    own = sweep(await start(Peer(smollm2)), dataset=f"jsonl:{lines}", tokenizer="smollm2", requests_per_point=3)
    stopped, _ = await run_in_process(own, tmp_path / "own")
    # a line without max_tokens and a workload without max_new_tokens: the request cannot be sized
    assert stopped.end is SweepEnd.STOPPED
    assert "has no max_tokens and the workload sets no max_new_tokens" in stopped.message, stopped.message


async def test_sharegpt_first_turns_with_their_answer_lengths(start: Start, smollm2: LocalTokenizer,
                                                              tmp_path: Path) -> None:
    peer = Peer(smollm2)
    raw = sweep(await start(peer), dataset="sharegpt", tokenizer="smollm2", concurrency=[1, 2],
                requests_per_point=4, warmup_requests=1)
    result, results = await run_in_process(raw, tmp_path / "out")
    assert result.end is SweepEnd.COMPLETED, result.message
    from bench_client.datasets import read_sharegpt

    conversations = {c.prompt: c.completion for c in read_sharegpt().conversations}
    measured = peer.bodies
    assert len(measured) == 2 * (4 + 1)
    for body in measured:
        assert body["prompt"] in conversations  # a first turn, as it is
        answer = smollm2.count(conversations[body["prompt"]])
        assert body["max_tokens"] == answer and 4 <= answer  # its answer's length (vLLM's filters)
        assert 4 <= smollm2.count(body["prompt"]) <= 1024
    first, second = (set(b["prompt"] for b in measured[i * 5 + 1:(i + 1) * 5]) for i in range(2))
    assert first != second  # each point its own sample
    assert {(r["max_new_tokens"], r["status"]) for r in results.records} == {(0, "ok")}


async def test_goodput_and_the_slo_search_resumes_from_its_records(start: Start, smollm2: LocalTokenizer,
                                                                   tmp_path: Path) -> None:
    # TTFT 100 ms per request in flight: 2 at once meet the 250 ms SLO (200 ms), 3 miss it (300 ms)
    peer = Peer(smollm2, ttft_per_request_s=0.1)
    raw = sweep(await start(peer), context_tokens=[16], max_new_tokens=[4], tokenizer="smollm2",
                requests_per_point=4, slo={"ttft_ms": 250.0},
                search={"over": "concurrency", "low": 1, "high": 8, "steps": 6, "attainment": 0.9})
    result, results = await run_in_process(raw, tmp_path / "out")
    assert result.end is SweepEnd.COMPLETED, result.message
    probes = [(r["concurrency"], r["search"]["step"], r["metrics"]["slo_attainment"]) for r in results.records]
    # high first (missed: 8 in flight wait), then low (met: one at a time), then the bisection the
    # recorded attainments lead to, until adjacent values
    assert [p[:2] for p in probes[:2]] == [(8, 1), (1, 2)] and probes[0][2] < 0.9 <= probes[1][2], probes
    assert [p[1] for p in probes] == list(range(1, len(probes) + 1))
    search = SearchConfig(over="concurrency", low=1, high=8, steps=6, attainment=0.9)
    replayed: list[Probe] = []
    for concurrency, _, attained in probes:
        assert next_probe(search, replayed) == concurrency, probes
        replayed.append(Probe(concurrency, attained))
    assert next_probe(search, replayed) is None
    found = result_of(search, replayed)
    assert (found.best, found.first_miss) == (2, 3), probes
    assert [p[0] for p in probes] == [8, 1, 4, 2, 3]
    for r in results.records:
        m = r["metrics"]
        assert r["slo"] == {"ttft_ms": 250.0}
        assert m["request_goodput"] == pytest.approx(m["good_requests"] / m["duration_s"])
    # cut the last probe off: a resumed sweep runs that one alone
    path = tmp_path / "out" / "results.jsonl"
    kept = path.read_text().splitlines()[:-1]
    path.write_text("\n".join(kept) + "\n")
    sent_before = len(peer.bodies)
    again, resumed = await run_in_process(raw, tmp_path / "out", resume=True)
    assert again.end is SweepEnd.COMPLETED and len(peer.bodies) - sent_before == 4
    assert [r["concurrency"] for r in resumed.records] == [p[0] for p in probes]
    # a finished search: nothing is sent, and the answer comes from the records
    results = ResultsDir.open(tmp_path / "out", resume=True)
    try:
        with SweepProgress(enabled=False) as progress:
            runner = SweepRunner(parse_config(raw), results, progress)
            done = await runner.run()
    finally:
        results.close()
    assert done.end is SweepEnd.COMPLETED and len(peer.bodies) - sent_before == 4
    assert [(label, base.tag(), found.best, found.first_miss) for label, base, found in runner.search_results] == [
        ("", "c16-n4-x8-rinf", 2, 3)]


async def test_a_time_bounded_point_sends_no_request_after_its_duration(start: Start, smollm2: LocalTokenizer,
                                                                         tmp_path: Path) -> None:
    peer = Peer(smollm2, token_delay_s=0.05)  # 4 tokens: about 0.2 s a request
    raw = sweep(await start(peer), context_tokens=[8], max_new_tokens=[4], tokenizer="smollm2",
                requests_per_point=50, duration_s=0.5)
    result, results = await run_in_process(raw, tmp_path / "out")
    assert result.end is SweepEnd.COMPLETED, result.message
    [record] = results.records
    sent = record["requests"]["sent"]
    assert 1 <= sent <= 4 and record["metrics"]["completed"] == sent == len(peer.bodies), record["requests"]
    assert record["duration_s"] == 0.5 and record["status"] == "ok"


def test_gamma_arrivals_by_burstiness() -> None:
    def gaps(burstiness: float) -> list[float]:
        offsets = arrival_offsets(4000, 10.0, random.Random(7), burstiness=burstiness)
        return [b - a for a, b in zip(offsets, offsets[1:], strict=False)]

    for burstiness in (0.25, 1.0, 4.0):
        g = gaps(burstiness)
        assert statistics.fmean(g) == pytest.approx(0.1, rel=0.08)  # the rate holds
        cv2 = statistics.pvariance(g) / statistics.fmean(g) ** 2
        assert cv2 == pytest.approx(1 / burstiness, rel=0.15)  # a gamma of shape b: CV^2 = 1/b
    assert arrival_offsets(3, math.inf, random.Random(0), burstiness=0.5) == [0.0, 0.0, 0.0]
    # burstiness 1 is the Poisson process the sweep always drew
    assert arrival_offsets(5, 2.0, random.Random(3)) == arrival_offsets(5, 2.0, random.Random(3), burstiness=1.0)


async def test_tgi_refuses_ids_and_its_top_p_rule_skips_the_point(smollm2: LocalTokenizer, tmp_path: Path) -> None:
    async with tgi_fake() as tgi:
        ids, ids_results = await run_in_process(
            sweep(tgi.url, context_tokens=[16], max_new_tokens=[4], prompt_format="token_ids", tokenizer="smollm2"),
            tmp_path / "ids")
        assert ids.end is SweepEnd.COMPLETED, ids.message
        [skipped] = ids_results.records
        assert (skipped["status"], skipped["skip_code"]) == ("skipped", "HTTP_422"), skipped
        assert "data did not match any variant of untagged enum PromptDeserializer" in skipped["message"]

        top_p, top_p_results = await run_in_process(
            sweep(tgi.url, context_tokens=[16], max_new_tokens=[4], top_p=1.0, tokenizer="smollm2"), tmp_path / "p")
        [refused] = top_p_results.records
        assert refused["status"] == "skipped" and "`top_p` must be > 0.0 and < 1.0" in refused["message"], refused

        text, text_results = await run_in_process(
            sweep(tgi.url, context_tokens=[16], max_new_tokens=[4], top_p=0.9), tmp_path / "text")
        assert text.end is SweepEnd.COMPLETED, text.message
        [ok] = text_results.records
        assert ok["status"] == "ok" and ok["metrics"]["total_output_tokens"] == 3 * 4, ok
        # no tokenizer named: TGI's own /tokenize sized the prompts (its BOS not counted)
        assert ok["tokenizer"] == f"the tokenize endpoint of {tgi.url}"
        assert ok["metrics"]["total_input_tokens"] in (3 * 16, 3 * 17), ok["metrics"]
