"""The prefix cache on a shared system prompt: median TTFT and output throughput with the cache on
and off, in one run.

    python benchmarks/prefix_cache.py [--model smollm2] [--dtype bfloat16] [--requests 48]

Every request is the same 1,024-token prefix followed by 64 tokens of its own, asks 64 new tokens
(ignore_eos), and 8 are in flight at a time (vLLM's `--random-prefix-len 1024 --random-input-len
64`). Each engine first serves one warm-up request with the prefix (with the cache on, that stores
it, as a system prompt would be after its first use). Prints both engines' figures and the ratios:
TTFT off / on (target >= 5) and throughput on / off (target >= 2).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_client.prompts import make_prompt
from engine.v1 import engine_pb2 as pb
from engine.v1 import engine_pb2_grpc
from tools.local_engine import EngineProcess

PREFIX, UNIQUE, NEW, CONCURRENCY = 1024, 64, 64, 8


def prompt(index: int) -> list[int]:
    """The shared prefix, then this request's own tokens (as the bench client's prefix_tokens builds them)."""
    return list(make_prompt(seed=0, length=PREFIX + UNIQUE, index=index, vocab_size=40003, avoid=(0, 1, 2),
                            prefix_tokens=PREFIX))


async def run(address: str, requests: int) -> tuple[float, float, int]:
    """(median TTFT s, output tok/s, cached prompt tokens per request, median) over `requests`."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)

        async def one(i: int) -> tuple[float, int]:
            ids = prompt(i)
            started, first, count, cached = time.perf_counter(), None, 0, 0
            async for msg in stub.Decode(pb.DecodeRequest(prompt_token_ids=pb.TokenIds(ids=ids), max_new_tokens=NEW,
                                                          ignore_eos=True)):
                if msg.token_ids and first is None:
                    first = time.perf_counter()
                count += len(msg.token_ids)
                cached = msg.usage.cached_prompt_tokens
            if count != NEW or first is None:
                raise RuntimeError(f"request {i} produced {count} tokens, expected {NEW}")
            return first - started, cached

        await one(-1)  # warm-up, with the prefix
        todo = iter(range(requests))
        results: list[tuple[float, int]] = []

        async def worker() -> None:
            for i in todo:
                results.append(await one(i))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        elapsed = time.perf_counter() - started
    return (statistics.median(t for t, _ in results), requests * NEW / elapsed,
            int(statistics.median(c for _, c in results)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=48)
    args = parser.parse_args()
    print(f"# {args.model} {args.dtype}: {PREFIX} shared + {UNIQUE} unique prompt tokens, {NEW} new, "
          f"concurrency {CONCURRENCY}, {args.requests} requests")
    figures = {}
    for name, flag in (("off", "0"), ("on", None)):
        extra = ["--prefix-cache-tokens", flag] if flag is not None else []  # on: the engine's default size
        with EngineProcess("--model", args.model, "--dtype", args.dtype, "--max-context", "2048", "--threads", "0",
                           *extra) as proc:
            figures[name] = ttft, tps, cached = asyncio.run(run(proc.address, args.requests))
        print(f"cache {name:>3}: TTFT median {ttft * 1e3:7.1f} ms  output {tps:7.1f} tok/s  "
              f"cached prompt tokens per request (median) {cached}", flush=True)
    print(f"TTFT off / on             : {figures['off'][0] / figures['on'][0]:6.2f}  (target >= 5)")
    print(f"throughput on / off       : {figures['on'][1] / figures['off'][1]:6.2f}  (target >= 2)")


if __name__ == "__main__":
    main()
