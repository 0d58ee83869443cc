"""How much the bench client itself adds to what it measures.

    .venv/bin/python benchmarks/client_overhead.py [--concurrency 32] [--requests 256] [--rounds 3]

Starts the `tiny` engine (compute negligible) unless --target names a running one, then alternates
two clients over the same prompts, seeded:
- baseline: a bare grpc.aio loop (a stub, a semaphore, a timestamp per message), and
- bench_client: the point runner the sweeps use (policy table, domain conversion, observers).
For each it reports median TTFT, median client-side overhead (client TTFT - engine-reported TTFT:
transport plus client), streamed messages and tokens per second, and client CPU per message, whose
inverse is the message rate one client process could sustain on one core. The verdict compares
bench_client with the baseline of the same run (targets: adds < 1 ms to median TTFT at concurrency
32; sustains >= 10,000 streamed tokens/s).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout

from bench_client.config import PolicyConfig, WorkloadConfig  # noqa: E402
from bench_client.point import PointRunner, PointSpec, RequestResult  # noqa: E402
from bench_client.prompts import make_prompt  # noqa: E402
from bench_client.rpc import EngineClient  # noqa: E402
from engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from tools.local_engine import EngineProcess  # noqa: E402


@dataclass(frozen=True)
class RoundResult:
    client: str
    ttft_ms: float  # median
    overhead_ms: float  # median of client TTFT - engine TTFT
    tokens: int
    messages: int
    wall_s: float
    cpu_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def messages_per_s(self) -> float:
        return self.messages / self.wall_s

    @property
    def cpu_us_per_message(self) -> float:
        return 1e6 * self.cpu_s / self.messages


class _NoHealth:
    async def wait_until_serving(self, timeout: float) -> bool:
        return False  # a benchmark run must not survive an engine outage: stop instead


class _NoObserver:
    def request_started(self, spec: PointSpec) -> None:
        return None

    def request_finished(self, spec: PointSpec, outcome: RequestResult) -> None:
        return None


async def baseline_round(target: str, prompts: list[tuple[int, ...]], concurrency: int,
                         max_new_tokens: int) -> RoundResult:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        slots = asyncio.Semaphore(concurrency)
        ttfts, overheads, counts = [], [], [0, 0]

        async def one(prompt: tuple[int, ...]) -> None:
            async with slots:
                request = engine_pb2.DecodeRequest(prompt_token_ids=engine_pb2.TokenIds(ids=prompt),
                                                   max_new_tokens=max_new_tokens, ignore_eos=True)
                sent, first, engine_ttft = time.perf_counter(), None, None
                async for message in stub.Decode(request, timeout=60):
                    if first is None:
                        first = time.perf_counter()
                    counts[0] += len(message.token_ids)
                    counts[1] += 1
                    if message.HasField("timing"):
                        engine_ttft = message.timing.time_to_first_token_seconds
                assert first is not None and engine_ttft is not None
                ttfts.append(first - sent)
                overheads.append(first - sent - engine_ttft)

        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return RoundResult("baseline", 1000 * statistics.median(ttfts), 1000 * statistics.median(overheads),
                           counts[0], counts[1], time.perf_counter() - wall, time.process_time() - cpu)


async def bench_client_round(target: str, requests: int, context: int, concurrency: int, max_new_tokens: int,
                             seed: int) -> RoundResult:
    client = EngineClient(target)
    try:
        info = await client.server_info()
        workload = WorkloadConfig(prompt_format="token_ids", context_tokens=(context,), max_new_tokens=(max_new_tokens,),
                                  concurrency=(concurrency,), requests_per_point=requests, warmup_requests=0,
                                  seed=seed)
        runner = PointRunner(client, info, workload, PolicyConfig(), _NoHealth(), _NoObserver(), "bench")
        cpu = time.process_time()
        outcome = await runner.run(PointSpec(context, max_new_tokens, concurrency, math.inf))
        cpu_s = time.process_time() - cpu
    finally:
        await client.close()
    timelines = [r.timeline for r in outcome.requests if r.timeline is not None]
    if len(timelines) != requests:
        raise RuntimeError(f"{requests - len(timelines)} of {requests} requests failed: "
                           f"{[r.status_code for r in outcome.requests if r.timeline is None][:5]}")
    ttfts = [t.ttft for t in timelines if t.ttft is not None]
    overheads = [t.ttft - t.engine_ttft_s for t in timelines if t.ttft is not None and t.engine_ttft_s is not None]
    return RoundResult("bench_client", 1000 * statistics.median(ttfts), 1000 * statistics.median(overheads),
                       sum(t.output_tokens for t in timelines), sum(len(t.arrivals) for t in timelines),
                       outcome.duration_s, cpu_s)


async def run(args: argparse.Namespace, target: str) -> list[RoundResult]:
    client = EngineClient(target)
    if not await client.wait_until_serving(60.0):
        raise RuntimeError(f"the engine at {target} was not SERVING within 60 s")
    info = await client.server_info()
    await client.close()
    prompts = [make_prompt(seed=args.seed, length=args.context, index=i, vocab_size=info.vocab_size,
                           avoid=(info.eos_token_id, info.bos_token_id)) for i in range(args.requests)]
    await baseline_round(target, prompts[: args.concurrency], args.concurrency, args.max_new_tokens)  # warmup
    results = []
    for _ in range(args.rounds):
        results.append(await baseline_round(target, prompts, args.concurrency, args.max_new_tokens))
        results.append(await bench_client_round(target, args.requests, args.context, args.concurrency,
                                                args.max_new_tokens, args.seed))
    return results


def summarize(results: list[RoundResult], concurrency: int) -> None:
    print(f"{'client':<13} {'TTFT p50 ms':>11} {'overhead p50 ms':>15} {'tokens/s':>9} {'messages/s':>10} "
          f"{'CPU us/msg':>10} {'msg/s per core':>14}")
    by_client: dict[str, list[RoundResult]] = {}
    for r in results:
        by_client.setdefault(r.client, []).append(r)
        print(f"{r.client:<13} {r.ttft_ms:>11.3f} {r.overhead_ms:>15.3f} {r.tokens_per_s:>9.0f} "
              f"{r.messages_per_s:>10.0f} {r.cpu_us_per_message:>10.1f} {1e6 / r.cpu_us_per_message:>14.0f}")
    base, ours = by_client["baseline"], by_client["bench_client"]

    def med(rows: list[RoundResult], attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in rows)

    added = med(ours, "overhead_ms") - med(base, "overhead_ms")
    capacity = 1e6 / med(ours, "cpu_us_per_message")
    print(f"\nbench_client vs baseline (medians over rounds), concurrency {concurrency}:")
    print(f"  TTFT overhead added by bench_client: {added:+.3f} ms (ratio of overheads "
          f"{med(ours, 'overhead_ms') / med(base, 'overhead_ms'):.2f}x); target < 1 ms: "
          f"{'PASS' if added < 1.0 else 'FAIL'}")
    print(f"  CPU per message: {med(ours, 'cpu_us_per_message'):.1f} us vs {med(base, 'cpu_us_per_message'):.1f} us "
          f"({med(ours, 'cpu_us_per_message') / med(base, 'cpu_us_per_message'):.2f}x)")
    print(f"  sustainable streamed messages/s on one core (1 / CPU per message): {capacity:.0f}; "
          f"observed tokens/s (engine-bound here): {med(ours, 'tokens_per_s'):.0f}; target >= 10,000: "
          f"{'PASS' if capacity >= 10_000 else 'FAIL'} (each message carries >= 1 token)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="a running engine (default: start the tiny preset)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    engine = None
    target = args.target
    if target is None:
        engine = EngineProcess("--model", "tiny", "--max-batch", str(max(64, args.concurrency)),
                               "--queue-capacity", "4096").start()
        target = engine.address
    try:
        results = asyncio.run(run(args, target))
    finally:
        if engine is not None:
            engine.signal()
            engine.wait(30)
    summarize(results, args.concurrency)


if __name__ == "__main__":
    main()
